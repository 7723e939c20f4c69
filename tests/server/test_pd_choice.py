"""The pd-router's choice of servers (qnext/server/pd_choice.py): a conversation's next turn goes back to the server
its earlier turns went to, new conversations spread over the least busy servers, completions chain on their text,
the memory stays bounded, and bad server lists are refused."""
from __future__ import annotations

import pytest

from qnext.server.pd_choice import InstanceChooser, prefix_chain


def chat(*turns: str, tools=None) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": t} for t in turns]}
    if tools is not None:
        body["tools"] = tools
    return body


def test_a_conversations_next_turn_goes_where_its_earlier_turns_went():
    chooser = InstanceChooser(["http://a", "http://b", "http://c"])
    first = {name: chooser.choose(prefix_chain(chat(name))) for name in ("x", "y", "z")}
    assert sorted(first.values()) == [0, 1, 2]                  # three new conversations, three servers
    for name in ("z", "x", "y"):
        assert chooser.choose(prefix_chain(chat(name, "more"))) == first[name]
        assert chooser.choose(prefix_chain(chat(name, "more", "and more"))) == first[name]


def test_new_conversations_go_to_the_least_busy_server():
    chooser = InstanceChooser(["http://a", "http://b"])
    chooser.started(0)
    chooser.started(0)
    assert chooser.choose(prefix_chain(chat("new"))) == 1
    chooser.finished(0)
    chooser.finished(0)
    chooser.started(1)
    assert chooser.choose(prefix_chain(chat("another"))) == 0


def test_the_chain_depends_on_every_earlier_piece_and_on_the_tools():
    a, b = prefix_chain(chat("one", "two")), prefix_chain(chat("uno", "two"))
    assert a[1] != b[1]                                          # same last message, other history
    assert prefix_chain(chat("one"))[0] == a[0]
    assert prefix_chain(chat("one", tools=[{"type": "function"}]))[0] != a[0]
    text = "x" * 600
    assert len(prefix_chain({"prompt": text})) == 3              # 256-character pieces
    assert prefix_chain({"prompt": text})[:2] == prefix_chain({"prompt": text[:512] + "y"})[:2]


def test_memory_is_bounded_and_forgets_the_least_recent_first():
    chooser = InstanceChooser(["http://a", "http://b"], max_keys=4)
    chooser.choose(prefix_chain(chat("old")))
    for i in range(4):
        chooser.choose(prefix_chain(chat(f"new{i}")))
    assert len(chooser._owner) == 4
    assert prefix_chain(chat("old"))[0] not in chooser._owner


@pytest.mark.parametrize("urls, message", [([], "at least one"), (["http://a", "http://a"], "twice")])
def test_bad_server_lists_are_refused(urls, message):
    with pytest.raises(ValueError, match=message):
        InstanceChooser(urls)
