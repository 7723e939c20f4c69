"""An adapter's identity for caching and routing: the sha256 digest of its weights (peft_format.py), never its name,
id or path. `hash_root` turns it into the root of its sequences' block hash chains (cache/hashing.py);
`adapter_hash_root` gives that root for a LoRARequest, reading the adapter once per version of its weights file
(a data parallel router keys its prefix table on it, as the replicas' caches do)."""
from __future__ import annotations

import collections
import hashlib
import threading
from pathlib import Path

from qnext.lora.peft_format import WEIGHTS_FILE, read_peft_adapter

_MAX_REMEMBERED = 256
_roots: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()
_lock = threading.Lock()


def hash_root(digest: str) -> bytes:
    """The root of the block hash chain of an adapter's sequences, from its weights digest."""
    return hashlib.sha256(b"lora:" + digest.encode()).digest()[:16]


def weights_key(path: str | Path) -> tuple:
    """(resolved directory, weights file mtime_ns, size): a new key whenever the weights file is written again."""
    weights = Path(path) / WEIGHTS_FILE
    stat = weights.stat() if weights.is_file() else None
    return str(Path(path).resolve()), stat and stat.st_mtime_ns, stat and stat.st_size


def adapter_hash_root(request) -> bytes:
    """hash_root of the adapter a LoRARequest names (AdapterError when it is not a readable adapter)."""
    key = weights_key(request.lora_path)
    with _lock:
        if key in _roots:
            _roots.move_to_end(key)
            return _roots[key]
    root = hash_root(read_peft_adapter(request.lora_path).digest)
    with _lock:
        _roots[key] = root
        while len(_roots) > _MAX_REMEMBERED:
            _roots.popitem(last=False)
    return root
