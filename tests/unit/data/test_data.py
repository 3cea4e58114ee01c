"""Data: packing loses nothing, labels are next tokens of the same document, loaders agree across layouts."""

import json
import random

import pytest
import torch

from xorl.config import DataConfig
from xorl.data.corpus import DataError, builtin_documents, read_documents
from xorl.data.loader import MicrobatchLoader, PackedDataset
from xorl.data.packing import IGNORE_INDEX, collate, pack_documents
from xorl.data.tokenizer import ByteTokenizer, build_tokenizer


def _random_docs(n=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randint(1, 90))] for _ in range(n)]


@pytest.mark.parametrize("packing", [True, False])
def test_packing_keeps_every_token_and_labels_stay_in_document(packing):
    docs = _random_docs()
    seqs = pack_documents(docs, seq_len=32, pad_id=999, packing=packing)
    assert all(len(s.input_ids) == 32 and sum(s.doc_lengths) == 32 for s in seqs)
    ids = torch.cat([s.input_ids for s in seqs])
    labels = torch.cat([s.labels for s in seqs])
    keep = ids != 999
    assert ids[keep].tolist() == [t for d in docs for t in d]  # nothing dropped or reordered
    # Independent expectation: the next token of the same document, IGNORE at each document's end.
    expected = [t for d in docs for t in (d[1:] + [IGNORE_INDEX])]
    assert labels[keep].tolist() == expected
    assert (labels[~keep] == IGNORE_INDEX).all()  # padding never counts
    for s in seqs:  # positions restart at 0 for every piece
        starts = [0] + torch.cumsum(torch.tensor(s.doc_lengths), 0).tolist()[:-1]
        for st, n in zip(starts, s.doc_lengths):
            assert s.position_ids[st:st + n].tolist() == list(range(n))


def test_collate_builds_global_cu_seqlens():
    seqs = pack_documents(_random_docs(10, seed=1), seq_len=16, pad_id=0)
    batch = collate(seqs[:3])
    assert batch["input_ids"].shape == (1, 48)
    lengths = [n for s in seqs[:3] for n in s.doc_lengths]
    assert batch["cu_seqlens"].tolist() == [0] + torch.cumsum(torch.tensor(lengths), 0).tolist()
    assert batch["max_seqlen"] == max(lengths)


def test_loader_splits_the_same_global_batch_across_dp_ranks():
    cfg = DataConfig(tokenizer="byte", dataset="builtin", seed=3, seq_len=48, packing=True, text_key="text")
    ds = PackedDataset(cfg)
    single = MicrobatchLoader(ds, micro_batch_size=1, gradient_accumulation_steps=4, dp_rank=0, dp_size=1)
    for step in (0, 5):
        ref = [mb["input_ids"] for mb in single.microbatches(step)]
        shards = [MicrobatchLoader(ds, 1, 2, rank, 2).microbatches(step) for rank in range(2)]
        # Global order: microbatch m of rank d is global index m * dp + d.
        got = [shards[d][m]["input_ids"] for m in range(2) for d in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_local_dataset_readers(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(3)))
    (tmp_path / "b.txt").write_text("first doc\nline two\n\nsecond doc\n")
    assert list(read_documents(str(tmp_path / "a.jsonl"), "body")) == ["doc 0", "doc 1", "doc 2"]
    assert list(read_documents(str(tmp_path / "b.txt"))) == ["first doc\nline two", "second doc"]
    with pytest.raises(DataError, match=r"a.jsonl:1: no key 'text' .*data.text_key"):
        list(read_documents(str(tmp_path / "a.jsonl"), "text"))
    with pytest.raises(DataError, match="jsonl"):  # .csv is read through datasets: an unknown type
        list(read_documents(str(tmp_path / "c.bin")))
    with pytest.raises(DataError, match="c.csv' does not exist"):
        list(read_documents(str(tmp_path / "c.csv")))


@pytest.mark.parametrize("name, content, expected", [
    ("bad.jsonl", b'{"text": "a"}\n\n{"text": "b"}\n{"text": "c", oops}\n', r"bad.jsonl:4: not valid JSON: .*col.* 15"),
    ("null.jsonl", b'{"text": "a"}\n{"text": null}\n', r"null.jsonl:2: 'text' is null, expected a string"),
    ("row.jsonl", b'"just a string"\n', r"row.jsonl:1: expected a JSON object with key 'text', got a string"),
    ("latin1.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9"),
    ("latin1.txt", b"fine\n\nstill fine\ncaf\xe9\n", r"latin1.txt:4: not UTF-8"),
])
def test_data_errors_name_the_file_and_the_true_line(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=expected):
        list(read_documents(str(tmp_path / name)))


def test_resuming_with_another_global_batch_sees_every_sequence_once():
    """2 data-parallel ranks for 3 steps, then 4 ranks from the consumed position: sequences 0..35
    of the global order, each exactly once (the reference is the dataset's own epoch order)."""
    cfg = DataConfig(tokenizer="byte", dataset="builtin", seed=5, seq_len=32, packing=True, text_key="text",
                     micro_batch_size=1)
    ds = PackedDataset(cfg, vocab_size=272)
    seen = []

    def run(dp_size: int, steps: range, consumed: int) -> int:
        loaders = [MicrobatchLoader(ds, 1, 2, rank, dp_size) for rank in range(dp_size)]
        for loader in loaders:
            loader.resume_at(steps.start, consumed)
        for step in steps:
            for loader in loaders:
                seen.extend(mb["input_ids"][0] for mb in loader.microbatches(step))
        return loaders[0].first_sequence(steps.stop)

    consumed = run(2, range(0, 3), 0)
    assert consumed == 12
    assert run(4, range(3, 6), consumed) == 36
    expected = [ds.sequences[i].input_ids for i in ds.order(0)[:36]]
    assert len(seen) == 36
    remaining = list(expected)
    for ids in seen:  # each seen sequence matches one expected sequence, none left over
        match = next(i for i, e in enumerate(remaining) if torch.equal(e, ids))
        remaining.pop(match)
    assert not remaining


def test_parquet_and_hf_tokenizer(tmp_path):
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"text": ["alpha beta", "gamma"]}).to_parquet(tmp_path / "d.parquet")
    assert list(read_documents(str(tmp_path / "d.parquet"))) == ["alpha beta", "gamma"]
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"alpha": 0, "beta": 1, "gamma": 2, "</s>": 3, "[UNK]": 4},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path))
    assert hf.encode("alpha gamma") == [0, 2, 3]


def test_byte_tokenizer_round_trip_and_builtin_corpus_is_deterministic():
    t = ByteTokenizer()
    text = "zig-zag ✓"
    assert t.decode(t.encode(text)) == text
    assert builtin_documents(50, seed=1) == builtin_documents(50, seed=1)
    assert builtin_documents(50, seed=1) != builtin_documents(50, seed=2)
