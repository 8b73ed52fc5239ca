"""The report of `edgekv run` (``-o report.json`` and the summary table), built in one place from a
``Session``'s stats (``edgekv/session.py``) for every runtime, plain runs and document runs alike.

Keys a runtime does not have are left out: eager runs add ``cache_capacity``, ``eviction_events``,
``memory.kv_cache_allocated`` and ``torch_threads``; compiled runs ``runtime``, ``artifact``,
``target`` and (plain runs) ``device`` / ``memory.device_peak``. A plain run has ``wall_seconds``
and ``generated_ids``; a document run ``question_scoring`` (compiled: ``question_rows``) and its
``document`` section, and its ``text`` is the answers'."""

from __future__ import annotations

from .memory import peak_rss_bytes


def kv_comparison(cfg, kv_bytes: int, sequence_tokens: int) -> dict:
    """The KV cache a run held next to what the full cache of the same sequence would hold (in
    fp32, the format the model computes in, whatever ``--kv-dtype`` the run stored)."""
    from .memory import kv_cache_bytes

    full = kv_cache_bytes(cfg, sequence_tokens)
    return {"kv_cache": kv_bytes, "full_cache": full, "sequence_tokens": sequence_tokens,
            "saved_fraction": (1 - kv_bytes / full) if full else 0.0}


def _rate(tokens, seconds):
    return tokens / seconds if seconds else None


def decode_text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def build_report(session, model, *, prompt_tokens: int = 0, generated_ids: list[int] | None = None,
                 wall_seconds: float | None = None, document=None, question_scoring: bool = False) -> dict:
    """The report of one run on ``session``; ``model``: its tokenizer (texts) and config (the full
    cache it is set against). A plain run gives ``prompt_tokens``, ``generated_ids`` and
    ``wall_seconds``, its timings are the session's; a document run gives its ``DocumentRun``
    (``edgekv/document.py``, whose answers get their text here) with the timings taken around its
    calls, and whether the document was read knowing the questions."""
    stats = session.session_stats()
    report = dict(session.describe())
    if document is None:
        ids = list(generated_ids or [])
        text = decode_text(model.tokenizer, ids)
        generated = len(ids)
        prefill = (stats.prefill_tokens, stats.prefill_seconds)
        decode = (stats.decode_tokens, stats.decode_seconds)
        sequence_tokens = prompt_tokens + len(ids)
    else:
        answers = document.answers
        for a in answers:
            a.text = decode_text(model.tokenizer, a.generated_ids)
        report["question_scoring"] = question_scoring
        if stats.question_rows is not None:
            report["question_rows"] = stats.question_rows
        prompt_tokens = document.document_tokens
        text = "\n\n".join(a.text for a in answers)
        generated = sum(len(a.generated_ids) for a in answers)
        prefill = (document.document_tokens, document.prefill_seconds)
        # each answer's first token comes from its question's prefill, not from a decode step
        decode = (sum(max(0, len(a.generated_ids) - 1) for a in answers), sum(a.decode_seconds for a in answers))
        sequence_tokens = document.document_tokens + max(
            (a.question_tokens + len(a.generated_ids) for a in answers), default=0)
    report.update({"prompt_tokens": prompt_tokens, "generated_tokens": generated,
                   "prefill_tok_s": _rate(*prefill), "decode_tok_s": _rate(*decode),
                   "prefill_seconds": prefill[1], "decode_seconds": decode[1]})
    if document is None:
        report["wall_seconds"] = wall_seconds
    if stats.eviction_events is not None:
        report["eviction_events"] = stats.eviction_events
    report["cache_lengths"] = stats.cache_lengths
    if document is None and stats.device is not None:
        report["device"] = stats.device
    memory = {"plan": stats.memory_plan}
    if stats.kv_cache_allocated is not None:
        memory["kv_cache_allocated"] = stats.kv_cache_allocated
    memory["peak_rss"] = max(stats.peak_rss_bytes, peak_rss_bytes())
    if document is None and stats.device_bytes_peak:
        memory["device_peak"] = int(stats.device_bytes_peak)
    memory["vs_full_cache"] = kv_comparison(model.config, stats.planned_kv_bytes, sequence_tokens)
    report["memory"] = memory
    report["text"] = text
    if document is None:
        report["generated_ids"] = ids
    else:
        report["document"] = document.to_dict()
    if stats.torch_threads is not None:
        report["torch_threads"] = stats.torch_threads
    from .threads import threads_in_use

    report["threads"] = {**threads_in_use(), **stats.threads}
    return report
