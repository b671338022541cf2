"""The demo's synthetic RAG corpus: N document pages, each a PNG image and a text file beside it.

Why synthetic: nothing can be downloaded where the demo runs, and the cache does not care what the
words mean. What matters is that every document is distinct (different image bytes give different
`mm_hash`es, different texts give different prefix hashes) and that a document's text is long enough
that recomputing its prefill costs real time. The same seed always gives the same files, so a second
run of the demo reuses the precomputed store entries' names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

#: Syllables for pronounceable synthetic words (the byte-level tokenizer makes every byte a token).
SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "sa", "vo", "ni", "dex", "par", "ul", "qe", "zor", "fi", "bra")
QUESTIONS = (
    "What is the main claim of this document?",
    "Which figures does the page mention?",
    "Summarize the second paragraph.",
    "Who is the intended reader?",
    "What should be done next, according to the text?",
    "Which terms are defined on this page?",
)


@dataclass(frozen=True)
class Document:
    """One corpus entry: `text_path` (`docNN.txt`) and `image_path` (`docNN.png`, same stem)."""

    index: int
    text_path: Path
    image_path: Path

    @property
    def text(self) -> str:
        return self.text_path.read_text()


def sentence(rng: random.Random) -> str:
    """One capitalised sentence of 5-12 synthetic words (the demo's and `bench serve`'s documents)."""
    text = " ".join(
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(5, 12))
    )
    return text[0].upper() + text[1:] + "."


def sentences(rng: random.Random, n_chars: int) -> str:
    """Sentences joined by spaces until they reach `n_chars` characters (the caller cuts the tail)."""
    out: list[str] = []
    length = 0
    while length < n_chars:
        out.append(sentence(rng))
        length += len(out[-1]) + 1
    return " ".join(out)


def _words(rng: random.Random, n_chars: int) -> str:
    """Sentences of synthetic words, cut to at most `n_chars` characters at a word boundary."""
    text = sentences(rng, n_chars)
    return text[: text.rfind(" ", 0, n_chars)] if len(text) > n_chars else text


def page_image(rng: random.Random, index: int, size: int):
    """A 'scanned page': coloured header, text-like bars, a chart, and its number; distinct per document."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(200, 255) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, size, size // 8], fill=tuple(rng.randint(0, 160) for _ in range(3)))
    draw.text((6, 4), f"DOC {index:03d}", fill=(255, 255, 255))
    y = size // 8 + 6
    while y < size * 0.6:
        draw.rectangle([8, y, 8 + rng.randint(size // 3, size - 16), y + 3], fill=(40, 40, 40))
        y += 8
    for bar in range(6):  # a bar chart whose heights differ per page
        height = rng.randint(8, size // 3)
        x = 12 + bar * (size // 7)
        draw.rectangle([x, size - 8 - height, x + size // 10, size - 8],
                       fill=tuple(rng.randint(0, 255) for _ in range(3)))
    # Pixel noise, so that pages differ everywhere (as scans do), not only in the drawn parts.
    noise = Image.effect_noise((size, size), 24).convert("RGB")
    return Image.blend(img, noise, 0.08)


def make_corpus(directory: Path, n_docs: int, *, chars: int = 800, image_size: int = 224, seed: int = 0
                ) -> list[Document]:
    """Write `n_docs` documents (text + PNG) into `directory`; existing identical files are rewritten as is."""
    if n_docs < 1:
        raise ValueError(f"the corpus needs at least one document, got {n_docs}")
    directory.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        rng = random.Random(f"{seed}:{i}")
        text_path, image_path = directory / f"doc{i:03d}.txt", directory / f"doc{i:03d}.png"
        text_path.write_text(f"Document {i}. " + _words(rng, chars - 16))
        page_image(rng, i, image_size).save(image_path, format="PNG")
        docs.append(Document(i, text_path, image_path))
    return docs
