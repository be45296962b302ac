r"""On-disk cache of a trained population and its measures, safe to interrupt.

Layout under ``DIR/<experiment>/``:

```text
members/<id>.safetensors   trained weights
members/<id>.json          hyperparameters, train/test metrics, gap
measures/<id>.json         sharpness values of the member, keyed by the protocol hash
results.json               the summary (quotient_manifolds.experiments.report)
```

With ``weights_root``, the weights go to ``weights_root/<experiment>/members/`` instead and
the folder above holds only the (small) records, which can be kept under version control
while the weights stay on a scratch disk.

Every file is written to a temporary name in the same folder and moved into place with
``os.replace``, so a crash or Ctrl-C never leaves a half-written file, and a re-run
skips every member (and every measure) that is already on disk.

Several processes may work on one population at once: `PopulationStore.claim` takes an
advisory lock on a member (``fcntl.flock``, released by the kernel when its holder exits, even
if killed), so each process trains and measures the members no other one holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from .._deps import require

__all__ = ["PopulationStore", "atomic_write_text", "protocol_hash"]

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; results are meant to be shared
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def protocol_hash(settings: Mapping) -> str:
    """A short stable hash of a JSON-serialisable protocol description."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class PopulationStore:
    """Cache of one experiment's members under ``root/name``.

    Parameters
    ----------
    root : path
        The output folder (``--out DIR``).
    name : str
        The experiment name (``diagonal``, ``grokking``, …).
    weights_root : path, optional
        Where the weights go (``weights_root/name/members``); default: beside the records.
    """

    def __init__(self, root: str | os.PathLike, name: str, *,
                 weights_root: str | os.PathLike | None = None) -> None:
        self.dir = Path(root) / name
        self.members_dir = self.dir / "members"
        self.measures_dir = self.dir / "measures"
        self.weights_dir = (self.members_dir if weights_root is None
                            else Path(weights_root) / name / "members")
        for d in (self.members_dir, self.measures_dir, self.weights_dir):
            d.mkdir(parents=True, exist_ok=True)

    # -- members -------------------------------------------------------------------
    def has_member(self, member_id: str) -> bool:
        """Whether the weights and metadata of ``member_id`` are both on disk."""
        return self.has_meta(member_id) and self.has_weights(member_id)

    def has_meta(self, member_id: str) -> bool:
        """Whether the metadata (training record) of ``member_id`` is on disk."""
        return (self.members_dir / f"{member_id}.json").exists()

    def has_weights(self, member_id: str) -> bool:
        """Whether the weights of ``member_id`` are on disk."""
        return (self.weights_dir / f"{member_id}.safetensors").exists()

    def save_member(self, member_id: str, state: Mapping[str, torch.Tensor], meta: Mapping) -> None:
        """Store weights (safetensors) first, then the metadata that marks the member done.

        Measures cached for an earlier member of the same id are removed: they belong to
        other weights.
        """
        save_file = require("safetensors.torch", "caching trained members").save_file

        (self.measures_dir / f"{member_id}.json").unlink(missing_ok=True)
        target = self.weights_dir / f"{member_id}.safetensors"
        fd, tmp = tempfile.mkstemp(dir=self.weights_dir, prefix=f".{member_id}.", suffix=".tmp")
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_UMASK)
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, tmp)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        atomic_write_text(self.members_dir / f"{member_id}.json",
                          json.dumps(dict(meta), indent=1, sort_keys=True, default=float))

    def train_missing(
        self,
        ids: Sequence[str],
        hypers: Sequence[Mapping],
        train: Callable[[Mapping], tuple[Mapping[str, torch.Tensor], Mapping]],
        *,
        desc: str,
        progress: bool = True,
    ) -> None:
        """Train and save every member not yet on disk; ``train(hyper) -> (state, meta)``."""
        from tqdm.auto import tqdm

        for mid, hyper in zip(tqdm(ids, desc=desc, file=sys.stderr, disable=not progress),
                              hypers, strict=True):
            if not self.has_member(mid):
                self.save_member(mid, *train(hyper))

    def load_member(self, member_id: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The weights and metadata of ``member_id``."""
        load_file = require("safetensors.torch", "reading cached members").load_file

        meta = json.loads((self.members_dir / f"{member_id}.json").read_text())
        return load_file(str(self.weights_dir / f"{member_id}.safetensors")), meta

    def load_meta(self, member_id: str) -> dict:
        """Only the metadata of ``member_id``."""
        return json.loads((self.members_dir / f"{member_id}.json").read_text())

    @contextlib.contextmanager
    def claim(self, member_id: str, *, wait: bool = True) -> Iterator[bool]:
        """Hold the lock of ``member_id`` for the ``with`` block; yields whether it was taken.

        With ``wait=False`` it yields ``False`` at once when another process holds the lock,
        with ``wait=True`` it blocks until that process is done (or has died).
        """
        path = self.weights_dir / f".{member_id}.lock"
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- measures ------------------------------------------------------------------
    def load_measures(self, member_id: str, protocol: str) -> dict:
        """Measures of ``member_id`` computed under ``protocol`` (empty if none)."""
        p = self.measures_dir / f"{member_id}.json"
        if not p.exists():
            return {}
        blob = json.loads(p.read_text())
        return blob["values"] if blob.get("protocol") == protocol else {}

    def save_measures(self, member_id: str, protocol: str, values: Mapping) -> None:
        """Store (overwrite) the measures of ``member_id`` under ``protocol``."""
        atomic_write_text(self.measures_dir / f"{member_id}.json",
                          json.dumps({"protocol": protocol, "values": dict(values)}, indent=1,
                                     sort_keys=True, default=float))

    def write_json(self, name: str, blob: Mapping) -> Path:
        """Write ``DIR/<experiment>/<name>`` atomically and return its path."""
        p = self.dir / name
        atomic_write_text(p, json.dumps(blob, indent=1, default=float))
        return p
