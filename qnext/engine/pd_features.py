"""The two per-request features of prefill/decode disaggregation (docs/pd.md), on the Sequence's extension point
(engine/sequence_features.py): a decode engine's request whose prompt a prefill engine computed, and a prefill
engine's request whose cache leaves for a decode engine after its first token."""
from __future__ import annotations

from qnext.engine.pd_transfer import PREFILLED, TransferredPrompt
from qnext.engine.sequence_features import SequenceFeature, Stop


class TransferredPromptFeature(SequenceFeature):
    """The prompt's KV and state fetched from a prefill engine (`transferred`): admitted with the prompt computed, its
    first step runs the first token only; the fetched blocks and state are written into its blocks and live row
    before that step (EngineCache.write_transferred)."""

    def __init__(self, transferred: TransferredPrompt, prompt_len: int):
        self.transferred, self.computed_tokens = transferred, prompt_len

    def admit(self, manager, engine_cache, seq):
        n, t = self.computed_tokens, self.transferred
        admission = manager.admit_transferred(seq.request_id, seq.token_view, n)
        if admission is not None:
            blocks = admission.block_table[t.num_held_blocks:-(-n // manager.config.block_size)]
            engine_cache.write_transferred(blocks, t.kv, admission.state_row, t.conv, t.recurrent)
        return admission

    def dropped(self, manager, seq) -> None:
        manager.transferred.drop(seq.request_id)          # the leading blocks held for it (CacheManager.transferred.hold)


class ExportPrefillFeature(SequenceFeature):
    """Stops after the first token (finish_reason "prefilled") unless that token ends the request, and leaves
    (seq, block table, live row, first token) in `outbox` for the export right after the step's postprocess (before
    anything writes the freed blocks or row: PrefillDecodeEnds.export_prefilled)."""

    def __init__(self, outbox: list):
        self.outbox = outbox

    def after_sample(self, seq, token, manager) -> Stop | None:
        rid = seq.request_id
        self.outbox.append((seq, list(manager.block_table(rid)), manager.state_rows(rid)[1], token))
        return PREFILLED, None
