"""Checkpoints through orbax's CheckpointManager: async writes, the last ``keep`` kept, each one
committed atomically (orbax writes a temporary directory and renames it when complete, so an
interrupted write leaves the previous checkpoint as the latest restorable one).

A checkpoint holds the training state (restored straight into the run's shardings) and the data
iterator's position (JSON), so a resumed run continues the exact sample order. Once committed,
each is sealed with its files' digests (``digests/STEP.json``), checked before it is restored:
a corrupt one is moved to ``quarantine/STEP``, never deleted."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Optional

import jax
import orbax.checkpoint as ocp

from jaxllm.outputs import check_readable_dir

# Words in a restore error that say the files could not be read, not that they are malformed.
_NOT_CORRUPTION = ("PERMISSION_DENIED", "Permission denied", "No space left", "UNAVAILABLE",
                   "Input/output error", "Read-only file system")


def _digests(root: str) -> dict:
    """Relative path -> sha256 of every file under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


class Checkpoints:
    def __init__(self, directory: str, keep: int, async_write: bool = True):
        self.dir = os.path.abspath(directory)
        self.mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_write, create=True))

    def latest(self) -> Optional[int]:
        return self.mngr.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        """Starts the write (async); training continues while it completes. The checkpoints
        committed before it are sealed first (their digests written)."""
        self.seal()
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     data=ocp.args.JsonSave(data_state)),
                       force=force)

    def restore(self, step: int, like_state) -> tuple[dict, dict]:
        """The state at ``step`` placed like ``like_state`` (same shapes, dtypes, shardings)."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              like_state)
        out = self.mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    @property
    def quarantine_dir(self) -> str:
        """Where checkpoints that are corrupt are moved (``quarantine/STEP``, out of orbax's
        sight: it reads integer-named directories only): kept as evidence, never deleted."""
        return os.path.join(self.dir, "quarantine")

    @property
    def digest_dir(self) -> str:
        return os.path.join(self.dir, "digests")

    def _committed(self) -> list:
        """Steps orbax has committed (renamed into their integer-named directory)."""
        try:
            return sorted(int(e) for e in os.listdir(self.dir) if e.isdigit())
        except OSError:
            return []

    def seal(self) -> None:
        """Write the file digests of every committed checkpoint that has none yet
        (``digests/STEP.json``: path -> sha256, the whole step directory), and drop those of
        steps orbax has since removed (max_to_keep). Restores check them first, so a flipped
        bit or a truncated file is found before the state is used."""
        steps = self._committed()
        try:
            os.makedirs(self.digest_dir, exist_ok=True)
            have = {e for e in os.listdir(self.digest_dir) if e.endswith(".json")}
        except OSError:
            return  # a read-only run: nothing to seal
        for step in steps:
            if f"{step}.json" not in have:
                try:
                    digests = _digests(os.path.join(self.dir, str(step)))
                except OSError:
                    continue  # removed or unreadable meanwhile: checked at restore
                tmp = os.path.join(self.digest_dir, f".{step}.json.tmp")
                with open(tmp, "w") as f:
                    json.dump(digests, f, indent=0, sort_keys=True)
                os.replace(tmp, os.path.join(self.digest_dir, f"{step}.json"))
        for name in have - {f"{s}.json" for s in steps}:
            os.remove(os.path.join(self.digest_dir, name))

    def _mismatch(self, step: int) -> Optional[str]:
        """Why this step's files differ from its digests (None: they match, or it has none:
        a checkpoint written before digests, or whose writer died before sealing it)."""
        path = os.path.join(self.digest_dir, f"{step}.json")
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                want = json.load(f)
        except ValueError:
            return f"its digest file {path} is not valid JSON"
        if not isinstance(want, dict):
            return f"its digest file {path} is not a JSON object of file digests"
        got = _digests(os.path.join(self.dir, str(step)))
        for name in sorted(set(want) | set(got)):
            if want.get(name) != got.get(name):
                what = ("is missing" if name not in got else "was not in the checkpoint"
                        if name not in want else "differs from its digest")
                return f"file {name} {what}"
        return None

    def _quarantine(self, step: int, reason: str) -> str:
        """Move a corrupt step (and its digests) to quarantine/STEP, saying so; never delete."""
        dest = os.path.join(self.quarantine_dir, str(step))
        if os.path.exists(dest):
            dest += time.strftime("-%Y%m%dT%H%M%S")
        try:
            os.makedirs(self.quarantine_dir, exist_ok=True)
            os.rename(os.path.join(self.dir, str(step)), dest)
            digests = os.path.join(self.digest_dir, f"{step}.json")
            if os.path.exists(digests):
                os.rename(digests, dest + ".digests.json")
        except OSError as e:
            raise ValueError(f"checkpoint step {step} in {self.dir} is corrupt ({reason}) and "
                             f"cannot be moved aside ({e.strerror}); move it out of the way by "
                             f"hand and run again") from None
        print(f"warning: checkpoint step {step} in {self.dir} is corrupt ({reason}); moved to "
              f"{dest}, trying the one before", file=sys.stderr)
        self.mngr.reload()
        return dest

    def restore_newest_good(self, like_state) -> tuple[dict, dict, int]:
        """(state, data position, step) of the newest checkpoint that restores.

        A failure is classified. Corruption -- the files differ from the digests written when
        the step was committed, or orbax cannot parse them -- moves that step to
        quarantine/STEP with a one-line warning and the one before is tried. Anything else --
        a file this process may not read (a run copied from another user, a share without read
        rights), an I/O error -- refuses in one line naming it and touches nothing: moving it
        would hide a permissions or disk problem as corruption. Nothing is ever deleted."""
        for step in sorted(self._committed(), reverse=True):
            bad = check_readable_dir(os.path.join(self.dir, str(step)))
            if bad:
                raise ValueError(f"checkpoint step {step} cannot be read ({bad}: permission "
                                 f"denied); give this user read access to {self.dir}, or "
                                 f"train into a new --out")
            try:
                reason = self._mismatch(step)
            except OSError as e:
                raise ValueError(f"checkpoint step {step} in {self.dir} cannot be read "
                                 f"({e.strerror}); nothing was moved") from None
            if reason:
                self._quarantine(step, reason)
                continue
            try:
                state, data = self.restore(step, like_state)
                return state, data, step
            except OSError as e:
                raise ValueError(f"checkpoint step {step} in {self.dir} cannot be read "
                                 f"({e.strerror or e}); nothing was moved") from None
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore: a format error
                msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                if any(k in msg for k in _NOT_CORRUPTION):
                    raise ValueError(f"checkpoint step {step} in {self.dir} cannot be read "
                                     f"({msg}); nothing was moved") from None
                self._quarantine(step, f"{type(e).__name__}: {msg}")
        raise ValueError(f"no checkpoint in {self.dir} restores (the corrupt ones are in "
                         f"{self.quarantine_dir}); start the run in a new --out")

    def wait(self) -> None:
        self.mngr.wait_until_finished()
        self.seal()

    def close(self) -> None:
        self.mngr.close()
