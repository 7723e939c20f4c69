"""Numerical building blocks shared by the text model (qnext/model) and the vision tower (qnext/vision): dense
projections in the checkpoint's layout, FP8 weights with block scales. They import nothing of qnext but each other."""
