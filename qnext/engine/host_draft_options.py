"""speculative_config of the drafting methods that need no head (docs/speculative.md, "Suffix and n-gram drafting"),
with vLLM's names: {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": 24,
"suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
"suffix_decoding_min_token_prob": 0.1} and {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n,
"prompt_lookup_max": m}. Checked here; EngineConfig calls `host_draft_options`."""
from __future__ import annotations

import dataclasses

HOST_DRAFT_METHODS = ("suffix", "ngram")
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
NGRAM_KEYS = {"prompt_lookup_min", "prompt_lookup_max"}
NGRAM_DEFAULT_LOOKUP = 5        # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is given


@dataclasses.dataclass(frozen=True)
class HostDraftOptions:
    method: str
    max_tree_depth: int = 24           # suffix: context tokens a match extends over (vLLM's default)
    max_cached_requests: int = 10000   # suffix: requests whose outputs the shared index keeps (0: none)
    max_spec_factor: float = 1.0       # suffix: drafts <= factor x match length
    min_token_prob: float = 0.1        # suffix: a draft's path probability must stay >= this
    prompt_lookup_min: int = NGRAM_DEFAULT_LOOKUP   # ngram: shortest and longest suffix matched
    prompt_lookup_max: int = NGRAM_DEFAULT_LOOKUP


def _int(spec: dict, name: str, default: int, low: int) -> int:
    value = spec.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {value!r}")
    return value


def _number(spec: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    value = spec.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low or (high is not None and
                                                                                          value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config {name} must be a number {bounds}, got {value!r}")
    return float(value)


def host_draft_options(spec: dict) -> HostDraftOptions:
    """The options of a suffix / ngram speculative_config (its method one of HOST_DRAFT_METHODS), checked: keys of the
    other method are refused, values in range."""
    method = spec["method"]
    other = (NGRAM_KEYS if method == "suffix" else SUFFIX_KEYS) | {"speculative_token_map"}
    wrong = sorted(set(spec) & other)
    if wrong:
        raise ValueError(f"speculative_config keys {wrong} do not apply to method {method!r}")
    if method == "suffix":
        return HostDraftOptions(method, max_tree_depth=_int(spec, "suffix_decoding_max_tree_depth", 24, 1),
                                max_cached_requests=_int(spec, "suffix_decoding_max_cached_requests", 10000, 0),
                                max_spec_factor=_number(spec, "suffix_decoding_max_spec_factor", 1.0, 0.0),
                                min_token_prob=_number(spec, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0))
    given = {name: _int(spec, name, 1, 1) for name in NGRAM_KEYS if spec.get(name) is not None}
    low = given.get("prompt_lookup_min", given.get("prompt_lookup_max", NGRAM_DEFAULT_LOOKUP))
    high = given.get("prompt_lookup_max", low)            # vLLM: one given stands for both
    if low > high:
        raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
    return HostDraftOptions(method, prompt_lookup_min=low, prompt_lookup_max=high)
