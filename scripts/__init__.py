"""The project's command-line scripts; a package so that tests import them (`from scripts import train_mtp`)."""
