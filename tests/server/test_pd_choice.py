"""The pd-router's choice of servers (qnext/server/pd_choice.py over the one prefix affinity router,
prefix_affinity.py): a conversation's next turn goes back to the server its earlier turns went to, new conversations spread over the least busy servers, completions chain on their text,
the memory stays bounded, and bad server lists are refused."""
from __future__ import annotations

import pytest

from qnext.server.pd_choice import ServerPool, prefix_chain


def chat(*turns: str, tools=None) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": t} for t in turns]}
    if tools is not None:
        body["tools"] = tools
    return body


def test_a_conversations_next_turn_goes_where_its_earlier_turns_went():
    chooser = ServerPool(["http://a", "http://b", "http://c"])
    first = {name: chooser.choose(prefix_chain(chat(name))) for name in ("x", "y", "z")}
    assert sorted(first.values()) == [0, 1, 2]                  # three new conversations, three servers
    for name in ("z", "x", "y"):
        assert chooser.choose(prefix_chain(chat(name, "more"))) == first[name]
        assert chooser.choose(prefix_chain(chat(name, "more", "and more"))) == first[name]


def test_new_conversations_go_to_the_least_busy_server():
    chooser = ServerPool(["http://a", "http://b"])
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
    chooser = ServerPool(["http://a"], max_keys=4)
    old = prefix_chain(chat("old"))
    chooser.choose(old)
    assert chooser.affinity.matched(0, old) == 1
    for i in range(4):
        chooser.choose(prefix_chain(chat(f"new{i}")))
    assert chooser.affinity.matched(0, old) == 0
    assert chooser.affinity.matched(0, prefix_chain(chat("new3"))) == 1


def test_a_longer_shared_prefix_beats_a_shorter_one():
    chooser = ServerPool(["http://a", "http://b"])
    assert chooser.choose(prefix_chain(chat("x", "y", "z"))) == 0
    assert chooser.choose(prefix_chain(chat("x", "w"))) == 0     # shares "x" with server a only
    chooser.affinity.record(1, prefix_chain(chat("x", "y")))
    assert chooser.choose(prefix_chain(chat("x", "y", "z", "more"))) == 0      # 3 keys at a beat 2 at b


@pytest.mark.parametrize("urls, message", [([], "at least one"), (["http://a", "http://a"], "twice")])
def test_bad_server_lists_are_refused(urls, message):
    with pytest.raises(ValueError, match=message):
        ServerPool(urls)
