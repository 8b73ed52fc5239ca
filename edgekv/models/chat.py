"""A model's chat template as the runtimes use it: the text before and after one user turn
(with the generation prompt), and prompts made of a document and a question about it.

A document and its question are encoded as two parts, so that the document's compressed
cache can be saved and each question appended later (``--save-cache`` / ``edgekv ask``) —
and a run of document then question is those two parts in a row, in every runtime (the
native tokenizer's ``ekv_tokenizer_encode_part`` does the same):

    document part   chat prefix + document
    question part   QUESTION_SEPARATOR + question + chat suffix
(without ``chat``: the document, and the separator + the question)."""

from __future__ import annotations

QUESTION_SEPARATOR = "\n\n"

# two user contents for checking that the chat template inserts the content verbatim: the
# second has what templates tend to alter (surrounding whitespace, which `| trim` strips;
# quotes and brackets, which escaping changes; non-ASCII text)
CHAT_SENTINEL = "EKVCHATSENTINEL"
CHAT_PROBE = "  \n A 'quoted' \"text\" {{ x }} <b>&amp;</b> 猫 😀\t\n  "


def chat_pieces(tokenizer) -> dict:
    """The chat template rendered around one user turn with the generation prompt, as
    {"prefix", "suffix"} (None, with a "reason", when there is no template or it does not insert
    the content verbatim)."""
    if not getattr(tokenizer, "chat_template", None):
        return {"prefix": None, "suffix": None, "reason": "the tokenizer has no chat template"}

    def render(content: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    try:
        first, second = render(CHAT_SENTINEL), render(CHAT_PROBE)
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many kinds
        return {"prefix": None, "suffix": None, "reason": f"the chat template does not render: {exc}"}
    if not isinstance(first, str) or first.count(CHAT_SENTINEL) != 1:
        return {"prefix": None, "suffix": None, "reason": "the chat template does not show the user content once"}
    prefix, suffix = first.split(CHAT_SENTINEL)
    if second != prefix + CHAT_PROBE + suffix:
        return {"prefix": None, "suffix": None,
                "reason": "the chat template changes the user content (trims or escapes it)"}
    return {"prefix": prefix, "suffix": suffix, "reason": None}


def document_text(tokenizer, document: str, chat: bool) -> str:
    return (_pieces(tokenizer)["prefix"] if chat else "") + document


def question_text(tokenizer, question: str, chat: bool) -> str:
    return QUESTION_SEPARATOR + question + (_pieces(tokenizer)["suffix"] if chat else "")


def encode_document(tokenizer, document: str, chat: bool) -> list[int]:
    return tokenizer(document_text(tokenizer, document, chat), add_special_tokens=False)["input_ids"]


def encode_question(tokenizer, question: str, chat: bool) -> list[int]:
    return tokenizer(question_text(tokenizer, question, chat), add_special_tokens=False)["input_ids"]


def _pieces(tokenizer) -> dict:
    pieces = chat_pieces(tokenizer)
    if pieces["prefix"] is None:
        raise ValueError(f"--chat: {pieces['reason']}; run without --chat")
    return pieces
