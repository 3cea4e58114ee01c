"""Read a W&B offline run's ``run-<id>.wandb`` file: its history rows and its config, without a server.

wandb's public ``Api`` reads runs from the W&B server only (an offline run is not there), and recent
wandb releases no longer ship a Python reader of the file. The file is wandb's own record log: a
7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log framing (32 KiB blocks; each
chunk a 7-byte header: CRC-32 of type byte + data, length, type FULL/FIRST/MIDDLE/LAST), each record
a protobuf ``wandb.proto.wandb_internal_pb2.Record`` (wandb's schema, imported from wandb itself).
Every chunk's CRC is checked, so a misread framing fails instead of returning garbage.
"""

from __future__ import annotations

import json
import struct
import zlib

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"{path}: not a W&B log"
    pos, pending = 7, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is zero padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # preallocated, unwritten space
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"{path}: bad CRC at byte {pos}"
        pos += HEADER + length
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: str) -> list[dict]:
    """Every ``run.log`` row: {key: value} with wandb's own ``_step``, ``_runtime``, ``_timestamp``."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(path: str) -> dict:
    """The run record: its project, display name and config ({key: value})."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            config = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                      for item in run.config.update}
            return {"project": run.project, "name": run.display_name, "config": config}
    raise AssertionError(f"{path}: no run record")
