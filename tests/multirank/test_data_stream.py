"""Streamed data (data.streaming): the same packed sequences as the in-memory packer, in file order,
split over data ranks like the in-memory loader, resumable on any number of ranks, and reading
only what the steps need."""

from __future__ import annotations

import json
import random

import pytest
import torch

from xorl.config import DataConfig
from xorl.data.packing import pack_documents
from xorl.data.stream import StreamedLoader
from xorl.data.tokenizer import ByteTokenizer


def _write_corpus(path, n_docs: int, seed: int, long_every: int = 7) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        n = rng.randint(40, 200) if i % long_every else rng.randint(300, 700)  # some span several sequences
        docs.append("".join(rng.choice("abcdefghij klmnop") for _ in range(n)))
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs


def _data(path, seq_len=128, packing=True):
    return DataConfig(dataset=str(path), text_key="text", seed=0, seq_len=seq_len, packing=packing)


@pytest.mark.parametrize("packing", [True, False])
def test_stream_packs_the_same_sequences_as_the_in_memory_packer(tmp_path, packing):
    path = tmp_path / "c.jsonl"
    docs = _write_corpus(path, 60, seed=1)
    tok = ByteTokenizer()
    ref = pack_documents((tok.encode(d) for d in docs), 128, tok.pad_id, packing=packing)
    loader = StreamedLoader(_data(path, packing=packing), tok, micro_batch_size=1, gradient_accumulation_steps=2,
                            dp_rank=0, dp_size=1)
    got = []
    for step in range((len(ref) - 1) // 2):  # whole steps inside the first epoch
        for mb in loader.microbatches(step):
            got.append(mb)
    for i, mb in enumerate(got):
        seq = ref[i]
        assert torch.equal(mb["input_ids"][0], seq.input_ids), i
        assert torch.equal(mb["labels"][0], seq.labels), i
        assert torch.equal(mb["position_ids"][0], seq.position_ids), i


def test_data_ranks_split_each_global_batch_once_and_resume_anywhere(tmp_path):
    path = tmp_path / "c.jsonl"
    _write_corpus(path, 80, seed=2)
    tok = ByteTokenizer()
    data = _data(path)

    def loader(dp_rank, dp_size, ga=2, mbs=1):
        return StreamedLoader(data, tok, micro_batch_size=mbs, gradient_accumulation_steps=ga,
                              dp_rank=dp_rank, dp_size=dp_size)

    one = loader(0, 1, ga=4)
    reference = [mb["input_ids"][0] for step in range(6) for mb in one.microbatches(step)]
    # Two data ranks: step t's 4 sequences, split the in-memory loader's way (rank d: m * dp + d).
    two = [loader(r, 2) for r in range(2)]
    for step in range(3):
        per_rank = [ld.microbatches(step) for ld in two]
        for m in range(2):
            for r in range(2):
                assert torch.equal(per_rank[r][m]["input_ids"][0], reference[step * 4 + m * 2 + r])
    # Resume the 2-rank run's state (after step 3 = 12 sequences) on 3 ranks with 2 microbatches:
    # the stream continues at sequence 12, every sequence once.
    state = two[0].state()
    assert state == two[1].state() and state["sequences"] == 12
    three = [loader(r, 3) for r in range(3)]
    for ld in three:
        ld.resume_at(3, 12, json.loads(json.dumps(state)))
    step3 = [ld.microbatches(3) for ld in three]
    seen = [step3[r][m]["input_ids"][0] for m in range(2) for r in range(3)]
    for k, row in enumerate(seen):
        assert torch.equal(row, reference[12 + k]), k
    with pytest.raises(ValueError, match="no stream position"):
        loader(0, 1).resume_at(3, 13, state)


def test_the_stream_reads_only_what_the_first_steps_need(tmp_path):
    path = tmp_path / "big.jsonl"
    _write_corpus(path, 20000, seed=3)  # ~2.6 MB
    loader = StreamedLoader(_data(path), ByteTokenizer(), micro_batch_size=2, gradient_accumulation_steps=2,
                            dp_rank=0, dp_size=2)
    loader.microbatches(0)
    read = loader.state()["offset"]
    size = path.stat().st_size
    assert 0 < read < size / 100, (read, size)  # 8 sequences of 128 tokens: a few KB of a 2.6 MB file


def test_streamed_training_matches_one_process_and_resumes_on_fewer_ranks(gloo_world, tmp_path):
    """FSDP over 2 data ranks trains to the single-process losses on a streamed JSONL; a 2-rank run
    stopped after step 3 resumes on 1 rank with the uninterrupted losses (the stream continues)."""
    from tests.support.parity_runs import max_rel_diff, tiny_config, train_losses

    path = tmp_path / "c.jsonl"
    _write_corpus(path, 400, seed=4)

    def config(out, **train):
        c = tiny_config(str(tmp_path / out), max_steps=6, **train)
        c.data.dataset, c.data.streaming = str(path), True
        return c

    one = gloo_world(1).run(train_losses, config("one", gradient_accumulation_steps=4))[0]
    two = gloo_world(2).run(train_losses, config("two", data_parallel_shard_size=2, gradient_accumulation_steps=2))[0]
    assert one[-1] < one[0] and max_rel_diff(two, one) <= 1e-5
    stopped = config("stopped", data_parallel_shard_size=2, gradient_accumulation_steps=2, save_steps=3)
    first = gloo_world(2).run(train_losses, stopped, 3)[0]
    resumed = config("stopped", gradient_accumulation_steps=4, resume=True)
    rest = gloo_world(1).run(train_losses, resumed)[0]
    assert len(rest) == 3 and max_rel_diff(first + rest, one) <= 1e-5


@pytest.mark.parametrize("source", ["jsonl", "parquet (datasets)", "save_to_disk (datasets)"])
def test_streamed_chat_rows_pack_as_in_memory_and_resume_exactly(tmp_path, source):
    """messages rows streamed (xorl's JSONL reader, or a datasets IterableDataset) give the in-memory
    packer's sequences in file order, masks included; a loader restored from the JSON state after step 2
    continues with the uninterrupted sequences (a document carried over a boundary included)."""
    datasets = pytest.importorskip("datasets")
    from tests.support.chat_data import conversations, make_chat_tokenizer, write_jsonl
    from xorl.data.loader import PackedDataset
    from xorl.data.tokenizer import build_tokenizer

    tok_path = make_chat_tokenizer(tmp_path / "tok")
    rows = [{"messages": m} for m in conversations(60, seed=6, turns=2)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    if source.startswith("parquet"):
        path = str(tmp_path / "chat.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
    elif source.startswith("save_to_disk"):
        path = str(tmp_path / "saved")
        datasets.Dataset.from_list(rows).save_to_disk(path)
    data = DataConfig(dataset=path, tokenizer=tok_path, seq_len=96, streaming=True)
    ref = PackedDataset(DataConfig(dataset=str(tmp_path / "chat.jsonl"), tokenizer=tok_path, seq_len=96)).sequences
    tok = build_tokenizer(tok_path)

    def loader():
        return StreamedLoader(data, tok, micro_batch_size=1, gradient_accumulation_steps=2, dp_rank=0, dp_size=1)

    one = loader()
    assert one.encoder.format == "messages" and one.through_datasets == (source != "jsonl")
    got = [mb for step in range(5) for mb in one.microbatches(step)]
    for i, mb in enumerate(got):
        assert torch.equal(mb["input_ids"][0], ref[i].input_ids), i
        assert torch.equal(mb["labels"][0], ref[i].labels), i
    assert any((mb["labels"][0] == -100).sum() > (mb["input_ids"][0] == tok.pad_id).sum() for mb in got)  # masked
    stopped = loader()
    for step in range(2):
        stopped.microbatches(step)
    state = json.loads(json.dumps(stopped.state()))
    assert state["carry"] and state["carry_labels"]  # a conversation waits for the next sequence, masks with it
    resumed = loader()
    resumed.resume_at(2, 4, state)
    rest = [mb for step in range(2, 5) for mb in resumed.microbatches(step)]
    for i, mb in enumerate(rest):
        assert torch.equal(mb["input_ids"][0], got[4 + i]["input_ids"][0]), i
        assert torch.equal(mb["labels"][0], got[4 + i]["labels"][0]), i
