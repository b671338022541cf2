"""The workload of `tiercache bench serve`: multi-turn chat sessions over a Zipf-popular document pool.

Why this shape: it is what makes an offload tier pay or not. Every turn resends the whole conversation
(as chat clients do), so turn k+1's prompt starts with turn k's; sessions on the same document share
that document's prefix; a few documents are asked about often and the rest rarely (Zipf). Together the
distinct prefixes (the working set) are made several times larger than vLLM's own KV cache, the regime
where vLLM's prefix cache evicts what later requests need again.

Why per-level documents: one server serves every concurrency level of a case. Each level gets its own
document pool (a level tag opens every document), so no level finds the previous level's prefixes in any
cache and every level starts cold, with a working set of the same size.

Token counts are exact without a tokenizer: the generated models use a byte-level tokenizer with no
merges (one token per byte), the chat template is ours (`CHAT_TEMPLATE`, mirrored by `render`), and the
answers are restricted to printable ASCII (`ascii_token_ids`), so an answer resent as history is
exactly the tokens the model produced.

Multimodal traces (`images` set): every document also has a page image, sent with the conversation's
first message and resent with the history on every later turn, as chat clients do. Some sessions ask
about the page alone (`page_only`: the image and a question, no text), so the same image arrives behind
different text: vLLM's BLIP-2 puts the image's query tokens first, so those requests share the image but
not the KV chunk that holds it, and it is the encoder cache (not the KV cache) that spares the encoder.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.demo.corpus import sentences

#: Each message as "role: content" on its own line, then the assistant's cue; `render` mirrors it.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_QUESTIONS = (
    "What is the main claim of this document?",
    "Which figures does the text mention?",
    "Summarize the second paragraph.",
    "Who is the intended reader?",
    "What should be done next, according to the text?",
    "Which terms are defined here?",
    "Is anything in it contradicted later?",
    "Give one example from the text.",
)


@dataclass(frozen=True)
class Session:
    """One user's conversation: a document and one question per turn (the first turn carries the document)."""

    index: int
    doc: int
    questions: tuple[str, ...]
    #: multimodal traces only: the first turn carries the page image and the question, not the text
    page_only: bool = False


@dataclass(frozen=True)
class Workload:
    """The trace of one concurrency level: its document pool and its sessions, in arrival order."""

    level: int
    docs: tuple[str, ...]
    sessions: tuple[Session, ...]
    #: one image per document (a data: URL), empty for a text-only trace
    images: tuple[str, ...] = ()
    #: prompt tokens the model makes of one image (BLIP-2: its query tokens), for the working-set count
    image_tokens: int = 0

    @property
    def requests(self) -> int:
        return sum(len(s.questions) for s in self.sessions)


def _words(rng: random.Random, n_chars: int) -> str:
    """Sentences of synthetic words, exactly `n_chars` characters (ASCII: one token per character)."""
    return sentences(rng, n_chars)[:n_chars]


def make_workload(level: int, *, n_docs: int, doc_tokens: int, sessions: int, turns: int, zipf_alpha: float,
                  seed: int, images: tuple[str, ...] = (), image_tokens: int = 0, page_only_every: int = 0
                  ) -> Workload:
    """The level's trace, the same for every case (deterministic in all arguments).

    `images` (one per document) makes it multimodal; then every `page_only_every`-th session (0: none)
    asks about the page image alone.
    """
    if images and len(images) != n_docs:
        raise ValueError(f"one image per document: {len(images)} images for {n_docs} documents")
    docs = tuple(f"Document {level}.{i}. " + _words(random.Random(f"{seed}:{level}:doc:{i}"), doc_tokens)
                 for i in range(n_docs))
    rng = random.Random(f"{seed}:{level}:sessions")
    weights = [1.0 / (i + 1) ** zipf_alpha for i in range(n_docs)]
    out = []
    for s in range(sessions):
        doc = rng.choices(range(n_docs), weights=weights)[0]
        questions = tuple(f"{rng.choice(_QUESTIONS)} (user {s}, turn {t + 1})" for t in range(turns))
        page_only = bool(images) and page_only_every > 0 and s % page_only_every == page_only_every - 1
        out.append(Session(s, doc, questions, page_only))
    return Workload(level, docs, tuple(out), tuple(images), image_tokens if images else 0)


def messages_for(workload: Workload, session: Session, turn: int, answers: list[str]) -> list[dict[str, Any]]:
    """The chat messages of `turn` (0-based): the whole history so far, then the turn's question.

    In a multimodal trace the first message is `[image, text]`; the chat template sees only its text
    (content format "string") and vLLM's BLIP-2 processor puts the image's tokens before the prompt.
    """
    msgs: list[dict[str, Any]] = []
    for t in range(turn + 1):
        question = session.questions[t]
        if t > 0:
            content: Any = question
        elif session.page_only:
            # the user's own words right after the image, as in real traffic: no KV chunk is shared
            content = f"User {session.index} asks about this page: {question}"
        else:
            content = f"{workload.docs[session.doc]}\n\nQuestion: {question}"
        if t == 0 and workload.images:
            content = [{"type": "image_url", "image_url": {"url": workload.images[session.doc]}},
                       {"type": "text", "text": content}]
        msgs.append({"role": "user", "content": content})
        if t < turn:
            msgs.append({"role": "assistant", "content": answers[t]})
    return msgs


def _text(content: Any) -> str:
    """A message's text as the "string" content format passes it to the template (image parts dropped)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


def render(messages: list[dict[str, Any]]) -> str:
    """The prompt text `CHAT_TEMPLATE` makes of `messages` (with the generation cue)."""
    return "".join(f"{m['role']}: {_text(m['content'])}\n" for m in messages) + "assistant: "


def working_set_tokens(workload: Workload, answer_tokens: int) -> tuple[int, int]:
    """(distinct prefix tokens of the whole trace, longest prompt in tokens).

    The distinct prefixes are the nodes of the token trie of all prompts: sort the last prompt of every
    session (every earlier prompt is a prefix of it) plus its last answer, and sum each one's length minus
    its common prefix with the one before. Answers are counted at `answer_tokens` each (max_tokens), with
    text unique per session and turn, as generated answers are. An image counts as `image_tokens`
    characters unique to its document, in front of the prompt (where BLIP-2 puts them).
    """
    texts = []
    longest = 0
    for session in workload.sessions:
        answers = [f"{session.index}-{t}".ljust(answer_tokens, "~")[:answer_tokens]
                   for t in range(len(session.questions))]
        image = f"\x00{session.doc}".ljust(workload.image_tokens, "\x01")[:workload.image_tokens]
        last = image + render(messages_for(workload, session, len(session.questions) - 1, answers))
        longest = max(longest, len(last))
        texts.append(last + answers[-1])
    texts.sort()
    total = 0
    previous = ""
    for text in texts:
        common = 0
        for a, b in zip(previous, text, strict=False):
            if a != b:
                break
            common += 1
        total += len(text) - common
        previous = text
    return total, longest


@dataclass(frozen=True)
class KVGeometry:
    """What one token's KV costs in vLLM's cache for a model: 2 (K, V) x layers x KV heads x head size x dtype."""

    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * self.dtype_bytes


def kv_geometry(model_dir: Path, dtype_bytes: int = 4) -> KVGeometry:
    """The geometry from the model's config.json (the demo's server runs `--dtype float32`: 4 bytes); for a
    vision-language model, its language model's (`text_config`: the only part with a KV cache)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    heads = int(cfg["num_attention_heads"])
    head_size = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return KVGeometry(int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads", heads)), head_size,
                      dtype_bytes)


def kv_budget_tokens(working_set: int, ratio: float, min_tokens: int, block_size: int) -> int:
    """vLLM's KV budget in tokens: the working set / `ratio` in whole blocks (rounded down, so the ratio is at
    least `ratio`), never below `min_tokens`
    (vLLM refuses to start when one request of max_model_len does not fit)."""
    return max(math.floor(working_set / ratio / block_size), math.ceil(min_tokens / block_size)) * block_size


def ascii_token_ids(model_dir: Path) -> list[int]:
    """Token ids of the printable ASCII characters (space to '~') in the model's byte-level tokenizer.

    Answers are restricted to them (vLLM's `allowed_token_ids`): random weights otherwise emit bytes
    that are not valid UTF-8, which come back in the next turn's history as U+FFFD (three tokens each).
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: set[int] = set()
    for code in range(32, 127):
        ids.update(tok.encode(chr(code)).ids)
    return sorted(ids)
