"""The one engine interface (qnext/served_engine.py) and the one front the HTTP side holds (server/engine_front.py):
every engine a server drives and every front implements all of it, explicitly; no class wraps the engine by passing
every attribute through (`__getattr__`), and a wrapper reaches nothing of the inner engine beyond the interface."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from qnext.distributed.served_lockstep import ServedLockstepEngine
from qnext.engine.llm_engine import LLMEngine
from qnext.served_engine import EngineSnapshot, ForwardingEngine, ServedEngine
from qnext.server.data_parallel import DataParallelEngine, ReplicaLoop
from qnext.server.engine_front import EngineFront
from qnext.server.engine_loop import AsyncEngine
from qnext.server.pd_role_engines import DecodeRoleEngine, PrefillRoleEngine
from qnext.server.replica_process import ProcessReplica

ROOT = Path(__file__).resolve().parents[2]
ENGINES = [LLMEngine, PrefillRoleEngine, DecodeRoleEngine, ServedLockstepEngine]
FRONTS = [AsyncEngine, ReplicaLoop, ProcessReplica, DataParallelEngine]


def interface(abc_class) -> set[str]:
    return {name for name, member in vars(abc_class).items() if getattr(member, "__isabstractmethod__", False)}


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_every_served_engine_implements_the_whole_interface(cls):
    assert issubclass(cls, ServedEngine) and not inspect.isabstract(cls), cls.__abstractmethods__
    for name in interface(ServedEngine):
        assert not getattr(getattr(cls, name), "__isabstractmethod__", False), name


@pytest.mark.parametrize("cls", FRONTS, ids=lambda c: c.__name__)
def test_every_engine_front_implements_the_whole_interface(cls):
    assert issubclass(cls, EngineFront) and not inspect.isabstract(cls), cls.__abstractmethods__


def test_the_interface_names_the_calls_the_engine_loop_makes():
    assert interface(ServedEngine) == {"served_model", "add_request", "abort_request", "release",
                                       "has_unfinished_requests", "step", "take_failed_requests",
                                       "running_request_ids", "stream_text", "status", "close"}


def test_an_engine_missing_a_member_cannot_be_built():
    class Partial(ServedEngine):
        def step(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_no_class_passes_every_attribute_through():
    """Module-level __getattr__ (lazy imports, qnext/__init__.py) is no wrapper; a class's is."""
    wrappers = []
    for path in sorted((ROOT / "qnext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                wrappers += [f"{path.relative_to(ROOT)}: {node.name}.{f.name}" for f in node.body
                             if isinstance(f, ast.FunctionDef) and f.name in ("__getattr__", "__getattribute__")]
    assert not wrappers, wrappers


class _Inner(ServedEngine):
    """An engine with one more member than the interface."""
    served_model = None

    def add_request(self, request_id, prompt, params=None): ...
    def abort_request(self, request_id): ...
    def release(self, request_id): ...
    def has_unfinished_requests(self): return False
    def step(self): return []
    def take_failed_requests(self): return []
    def running_request_ids(self): return []
    def stream_text(self, request_id, index=0): return ""
    def status(self): return EngineSnapshot(num_running=3, num_waiting=1)
    def close(self): ...
    def update_weights(self, params): ...


def test_a_wrapper_reaches_the_interface_and_nothing_else():
    wrapped = DecodeRoleEngine(_Inner())
    assert wrapped.status().num_running == 3 and wrapped.status().num_waiting == 1
    assert not hasattr(wrapped, "update_weights")
    public = {n for n in dir(ForwardingEngine) if not n.startswith("_")}
    assert public == interface(ServedEngine)
    wrapped.close()
