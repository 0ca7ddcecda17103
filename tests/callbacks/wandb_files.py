"""W&B's offline run files read back: the records of a `run-<id>.wandb` transaction log, decoded with wandb's own
protobuf messages (wandb 0.19+ ships no Python reader; the file is a LevelDB-style log of `Record`s)."""
from __future__ import annotations

import glob
import json
import os
import time

HEADER = 7   # ":W&B", magic 0xBEE1, version
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list:
    """Every Record of one transaction log, in order."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, found, pending = HEADER, [], b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:   # a block's tail too short for a record header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == FULL:
            found.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            found.append(pending + chunk)
        else:   # zeros: the end of what was written
            break
    parsed = []
    for raw in found:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def offline_runs(wandb_dir) -> list[str]:
    """The transaction logs of the offline runs under `wandb_dir`, oldest first."""
    return sorted(glob.glob(os.path.join(os.fspath(wandb_dir), "wandb", "offline-run-*", "run-*.wandb")),
                  key=os.path.getmtime)


def logged_run(wandb_dir, epochs: int, timeout: float = 60.0) -> dict:
    """`read_run` of every offline run under `wandb_dir` once they hold `epochs` epoch rows: `run.finish()` may
    return before wandb's service has flushed the last records to the file."""
    deadline = time.monotonic() + timeout
    while True:
        run = read_run(offline_runs(wandb_dir))
        if sum("loss" in row for row in run["history"]) >= epochs or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def read_run(paths: list[str]) -> dict:
    """What the runs logged: {"ids", "history" (one dict per log call), "config", "summary"}."""
    ids, history, config, summary = set(), [], {}, {}
    for path in paths:
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update(_items(record.run.config.update))
            elif kind == "history":
                history.append(_items(record.history.item))
            elif kind == "config":
                config.update(_items(record.config.update))
            elif kind == "summary":
                summary.update(_items(record.summary.update))
    return {"ids": ids, "history": history, "config": config, "summary": summary}


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
