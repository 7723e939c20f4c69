"""Host post-processing of one request after a step: append its tokens, check its stops, detokenise, and build
the RequestOutput the user sees. No cache calls here (the scheduler's postprocess commits and frees)."""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from qnext.engine.sampled_token import SampledToken
from qnext.engine.sequence import Sequence, SequenceStatus
from qnext.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_entry
from qnext.sampling_params import SamplingParams
from qnext.structured.matcher import DEAD_END

Stop = tuple[str, "int | str | None"]      # (finish_reason, stop_reason)


def check_stop(params: SamplingParams, output_token_ids: Seq[int], eos_token_ids: Seq[int],
               num_tokens: int, max_model_len: int) -> Stop | None:
    """vLLM's token-level stop check after a token was appended -> (finish_reason, stop_reason) or None.
    Before min_tokens only the length limits stop a request. Eos (any of eos_token_ids, unless ignore_eos) gives
    ("stop", None); a stop_token_id gives ("stop", id); max_tokens or max_model_len gives ("length", None).
    num_tokens = prompt + output. Stop strings are the detokenizer's (IncrementalDetokenizer.update)."""
    num_output = len(output_token_ids)
    if num_output >= params.min_tokens and num_output > 0:
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            return "stop", None
        if last in params.stop_token_ids:
            return "stop", last
    if num_tokens >= max_model_len or (params.max_tokens is not None and num_output >= params.max_tokens):
        return "length", None
    return None


def device_stop_ids(params: SamplingParams, eos_token_ids: Seq[int]) -> list[int]:
    """The token ids that end a request once it has min_tokens (what a multi-step call checks on device)."""
    return ([] if params.ignore_eos else list(eos_token_ids)) + list(params.stop_token_ids)


def append_token(seq: Sequence, token_id: int, eos_token_ids: Seq[int], max_model_len: int) -> Stop | None:
    """Appends one token, checks its stop (check_stop), detokenises it (stop strings included) and returns the
    stop, or None."""
    out = seq.output_token_ids
    out.append(token_id)
    stop = check_stop(seq.params, out, eos_token_ids, seq.num_tokens, max_model_len)
    if seq.first_token_time is None:
        seq.first_token_time = time.perf_counter()
    if seq.detokenizer is not None:
        token_stop = stop is not None and stop[0] == "stop"
        stop_string = seq.detokenizer.update([token_id], stop_token_terminated=token_stop)
        if stop_string is not None:
            stop = ("stop", stop_string)
    return stop


def append_sampled(seq: Sequence, token: SampledToken, eos_token_ids: Seq[int], max_model_len: int) -> Stop | None:
    """append_token for one sampled token, with its logprobs when the request asked for them. A structured
    request's matcher takes the token first: a token its grammar rejects is not appended and ends the request
    (DEAD_END); a token that completes the grammar ends it with ("stop", None), min_tokens or not."""
    p = seq.params
    if seq.structured is not None and not seq.structured.advance(token.token_id):
        return DEAD_END, seq.structured.error
    if seq.thinking is not None:
        seq.thinking.advance(token.token_id)
    seq.cumulative_logprob += token.logprob
    if p.logprobs is not None:
        detok = seq.detokenizer
        decode = detok.tokenizer.decode_token if detok is not None else None
        seq.logprobs = seq.logprobs or []
        seq.logprobs.append(logprobs_entry(token.token_id, token.logprob, token.rank,
                                           token.top_ids if token.top_ids is not None else [],
                                           token.top_logprobs if token.top_logprobs is not None else [],
                                           p.logprobs, decode))
    stop = append_token(seq, token.token_id, eos_token_ids, max_model_len)
    if seq.structured is not None and seq.structured.is_complete and (stop is None or stop[0] == "length"):
        stop = "stop", None
    return stop


def append_window(seq: Sequence, tokens: Seq[SampledToken], eos_token_ids: Seq[int], max_model_len: int
                  ) -> Stop | None:
    """A multi-token step's tokens, appended one at a time as plain decoding does (append_sampled) up to and
    including the first that stops the request, a stop string's included: the request's tokens, text and logprobs
    are exactly plain decoding's. Tokens after the stop are dropped (their KV and states lie past what the cache
    publishes: the scheduler keeps num_computed_tokens at the tokens kept)."""
    for token in tokens:
        stop = append_sampled(seq, token, eos_token_ids, max_model_len)
        if stop is not None:
            return stop
    return None


def mark_finished(seq: Sequence, stop: Stop) -> None:
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason, seq.stop_reason = stop
    if seq.detokenizer is not None:
        seq.detokenizer.update([], finished=True)


def completion_output(seq: Sequence) -> CompletionOutput:
    detok = seq.detokenizer
    text = detok.get_next_output_text(seq.is_finished, delta=False) if detok is not None else ""
    return CompletionOutput(index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                            logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)


def request_output(seq: Sequence) -> RequestOutput:
    """The request's output: one completion per sample (n > 1: in index order; finished when all are)."""
    samples = seq.group or [seq]
    seq = samples[0]
    metrics = RequestMetrics(arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                             first_token_time=seq.first_token_time,
                             num_lost_to_missing_state_tokens=seq.num_lost_to_missing_state_tokens)
    return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                         outputs=[completion_output(s) for s in samples],
                         finished=all(s.is_finished for s in samples),
                         num_cached_tokens=seq.num_cached_tokens or 0, metrics=metrics)
