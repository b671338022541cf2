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
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Workload:
    """The trace of one concurrency level: its document pool and its sessions, in arrival order."""

    level: int
    docs: tuple[str, ...]
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.questions) for s in self.sessions)


def _words(rng: random.Random, n_chars: int) -> str:
    """Sentences of synthetic words, exactly `n_chars` characters (ASCII: one token per character)."""
    return sentences(rng, n_chars)[:n_chars]


def make_workload(level: int, *, n_docs: int, doc_tokens: int, sessions: int, turns: int, zipf_alpha: float,
                  seed: int) -> Workload:
    """The level's trace, the same for every case (deterministic in all arguments)."""
    docs = tuple(f"Document {level}.{i}. " + _words(random.Random(f"{seed}:{level}:doc:{i}"), doc_tokens)
                 for i in range(n_docs))
    rng = random.Random(f"{seed}:{level}:sessions")
    weights = [1.0 / (i + 1) ** zipf_alpha for i in range(n_docs)]
    out = []
    for s in range(sessions):
        doc = rng.choices(range(n_docs), weights=weights)[0]
        questions = tuple(f"{rng.choice(_QUESTIONS)} (user {s}, turn {t + 1})" for t in range(turns))
        out.append(Session(s, doc, questions))
    return Workload(level, docs, tuple(out))


def messages_for(workload: Workload, session: Session, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """The chat messages of `turn` (0-based): the whole history so far, then the turn's question."""
    msgs: list[dict[str, str]] = []
    for t in range(turn + 1):
        question = session.questions[t]
        content = f"{workload.docs[session.doc]}\n\nQuestion: {question}" if t == 0 else question
        msgs.append({"role": "user", "content": content})
        if t < turn:
            msgs.append({"role": "assistant", "content": answers[t]})
    return msgs


def render(messages: list[dict[str, str]]) -> str:
    """The prompt text `CHAT_TEMPLATE` makes of `messages` (with the generation cue)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def working_set_tokens(workload: Workload, answer_tokens: int) -> tuple[int, int]:
    """(distinct prefix tokens of the whole trace, longest prompt in tokens).

    The distinct prefixes are the nodes of the token trie of all prompts: sort the last prompt of every
    session (every earlier prompt is a prefix of it) plus its last answer, and sum each one's length minus
    its common prefix with the one before. Answers are counted at `answer_tokens` each (max_tokens), with
    text unique per session and turn, as generated answers are.
    """
    texts = []
    longest = 0
    for session in workload.sessions:
        answers = [f"{session.index}-{t}".ljust(answer_tokens, "~")[:answer_tokens]
                   for t in range(len(session.questions))]
        last = render(messages_for(workload, session, len(session.questions) - 1, answers))
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
    """The geometry from the model's config.json (the demo's server runs `--dtype float32`: 4 bytes)."""
    cfg = json.loads((model_dir / "config.json").read_text())
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
