"""A small language-model pretraining loop on aioloader: Parquet tokens mixed, packed, resumed.

Two tokenized corpora in Parquet ("web" and "code", written here: documents that follow simple
rules a tiny model can learn) are mixed 0.7 / 0.3 by `aioloader.mix`, read a RecordBatch of 64
documents at a time (`rows_per_sample=64`: the columnar fast path) and packed by `aioloader.pack`
into rows of 64 tokens with EOS after each document (`targets=True`: inputs and targets shifted by
one; `boundaries=True`: per-token document ids and positions, for a document mask so that no
token attends across documents). A tiny decoder-only transformer trains on the rows.

Half-way, the run is "stopped": model, optimizer and `packed.state_dict()` are saved in a
checkpoint, everything is thrown away and made anew from it, and training goes on. The batches
after the restart are those an uninterrupted run sees (checked at the end). Runs in well under a
minute on a CPU.

With `--text`, the same documents are read as text (a `text` column of words "t<id>") and
tokenized on the fly by `aioloader.tokenize` in the loader's decode threads: a word-level
`tokenizers.Tokenizer` made here (or, without `tokenizers` installed, a plain function
`list[str] -> list[list[int]]`). The batches are the same.

Usage: python examples/pretraining.py [--steps 80] [--folder DIR] [--text]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

import aioloader
from aioloader import Loader, mix, pack, sources, tokenize

VOCAB, EOS, SEQ_LEN, BATCH = 128, 0, 64, 8
LR = 1e-2


def write_corpora(folder: Path) -> dict[str, list[str]]:
    """Two corpora of documents (a `tokens` list<int32> column, the same as words in a `text`
    column, and a column not read):
    "web" counts up from a random start by a random step, "code" repeats a short random motif."""
    rng = np.random.default_rng(0)
    files: dict[str, list[str]] = {"web": [], "code": []}
    for name in files:
        for part in range(2):
            docs = []
            for _ in range(400):
                n = int(rng.integers(8, 120))
                if name == "web":
                    start, step = rng.integers(1, VOCAB), rng.integers(1, 4)
                    docs.append((start + step * np.arange(n)) % (VOCAB - 1) + 1)
                else:
                    motif = rng.integers(1, VOCAB, int(rng.integers(2, 6)))
                    docs.append(np.resize(motif, n))
            table = pa.table({
                "tokens": pa.array([d.astype(np.int32) for d in docs], pa.list_(pa.int32())),
                "text": pa.array([" ".join(f"t{t}" for t in d.tolist()) for d in docs]),
                "source": pa.array([name] * len(docs)),
            })  # fmt: skip
            path = folder / f"{name}-{part}.parquet"
            pq.write_table(table, path, row_group_size=100)
            files[name].append(str(path))
    return files


def word_tokenizer() -> Any:
    """The text's tokenizer, "t<id>" -> id: a word-level `tokenizers.Tokenizer` (made here, no
    download), or without `tokenizers` a plain function of a list of texts."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return lambda texts: [[int(word[1:]) for word in text.split()] for text in texts]
    vocab = {"[UNK]": EOS, **{f"t{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def make_packed(files: dict[str, list[str]], text: bool = False) -> aioloader.Packed:
    column = "text" if text else "tokens"
    corpora = {
        name: sources.parquet(paths, [column], rows_per_sample=64, seed=i)
        for i, (name, paths) in enumerate(files.items())
    }
    mixed = mix(corpora, {"web": 0.7, "code": 0.3}, seed=1, stop="cycle")  # train by steps
    # with text: tokenized in the decode threads into a "tokens" column, one call per RecordBatch
    decode = tokenize(word_tokenizer()) if text else None
    loader = Loader(mixed, batch_size=None, collate=None, decode=decode)
    return pack(loader, SEQ_LEN, batch_size=BATCH, eos=EOS, key="tokens", targets=True,
                boundaries=True)  # fmt: skip


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ_LEN + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(
        self, tokens: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        # a token sees the tokens before it in its own document only
        mask = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x, mask)
        out: torch.Tensor = self.head(x)
        return out


def step(model: TinyLM, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    rows = batch["tokens"]
    inputs, targets = rows[:, :-1], rows[:, 1:]
    ids, positions = batch["document_ids"][:, :-1], batch["positions"][:, :-1]
    logits = model(inputs, ids, positions)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train(
    files: dict[str, list[str]], steps: int, stop_at: int | None, text: bool = False
) -> tuple[list[float], list[Any]]:
    """Train for `steps`; with `stop_at`, checkpoint there, rebuild everything from the checkpoint
    and go on. The losses, and the rows of every batch."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    packed = make_packed(files, text)
    batches = iter(packed)
    losses, seen = [], []
    for n in range(steps):
        if n == stop_at:
            checkpoint = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "data": packed.state_dict()}, checkpoint)  # fmt: skip
            packed.close()  # the process "stops" here; all that is left is the checkpoint
            checkpoint.seek(0)
            saved = torch.load(checkpoint, weights_only=True)
            model, packed = TinyLM(), make_packed(files, text)
            model.load_state_dict(saved["model"])
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            optimizer.load_state_dict(saved["optimizer"])
            packed.load_state_dict(saved["data"])
            batches = iter(packed)
            print(f"step {n}: restarted from the checkpoint ({len(saved['data']['tokens'])} tokens "
                  "held by the packer were in it)")  # fmt: skip
        batch = next(batches)
        seen.append(batch["tokens"].clone())
        losses.append(step(model, optimizer, batch))
        if n % 10 == 0 or n == steps - 1:
            print(f"step {n:>3}: loss {losses[-1]:.3f}")
    packed.close()
    return losses, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--text", action="store_true", help="tokenize a text column on the fly")
    args = parser.parse_args()
    torch.set_num_threads(
        1
    )  # a tiny model: one thread is fastest, the loader's threads take the rest
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        files = write_corpora(folder)
        print(f"corpora: {sum(map(len, files.values()))} Parquet files in {folder}")
        if args.text:
            print(f"reading text, tokenized on the fly by {tokenize(word_tokenizer())!r}")
        losses, seen = train(files, args.steps, stop_at=args.steps // 2, text=args.text)
        k = max(len(losses) // 8, 1)
        print(f"loss: {np.mean(losses[:k]):.3f} over the first {k} steps, "
              f"{np.mean(losses[-k:]):.3f} over the last {k}")  # fmt: skip
        print("the same run without a restart:")
        _, uninterrupted = train(files, args.steps, stop_at=None, text=args.text)
        same = all(torch.equal(a, b) for a, b in zip(seen, uninterrupted, strict=True))
        print(
            f"the batches after the restart are the uninterrupted run's: {'yes' if same else 'no'}"
        )


if __name__ == "__main__":
    main()
