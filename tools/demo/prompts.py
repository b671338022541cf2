"""The serving prompt of a RAG query, and the chat template that passes it through unchanged.

Why `vllm_tiercache.tools.precompute.kv.rag_prompt`: a precomputed KV prefix is found only when the served prompt starts
with exactly the tokens the producer ran, and that function is the project's one builder of both.

The chat template prints each message's content and nothing else, so a chat request whose content is
`[image, text]` becomes exactly `text` after templating (content format "string"); vLLM's BLIP-2
processor then inserts the image's query tokens at the start of the prompt (BLIP-2 has no placeholder
string), as it does for the producer's offline request.
"""

from __future__ import annotations

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_prompt(document_text: str, question: str | None = None) -> str:
    """The RAG prompt text the producer also used (`vllm_tiercache.tools.precompute.kv.rag_prompt`, no template)."""
    from vllm_tiercache.tools.precompute.kv import rag_prompt

    return rag_prompt(document_text, question)
