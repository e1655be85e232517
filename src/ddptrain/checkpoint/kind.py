"""What a checkpoint path is, asked of the filesystem in this one place.

Every command that is given a checkpoint (`--resume_from`, `--init_from`, `ddptrain
export`, `evaluate`, `predict`, the run's own resume and rollback) reads what it was
given from one value, `resolve_checkpoint(path)`: a `.pt` step file, a DCP step
directory (whole, or torn by a save that did not finish), a run directory, an exported
`model.safetensors` or a directory of safetensors weights, or nothing at all:

    found = resolve_checkpoint(Path("runs/a/checkpoints/step_000000100"))
    if found.kind is CheckpointKind.DCP:  # read as a step directory, refused if not one
        ...

Which kind a run writes is decided before it starts (`ddptrain.checkpoint_kind`);
this module reads which kind a path already is. A link is reported (`link`), never
followed silently where the project refuses to read through one (`own_directory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.checkpoint_kind import CheckpointKind as CheckpointKind  # one name for callers
from ddptrain.checkpoint_kind import checkpoint_kind as checkpoint_kind

META = "meta.pt"  # a step directory's progress file: all but the sharded state
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's own index of a step directory
RUN_CONFIG = "config.yaml"  # a run directory's resolved config (and an export's, beside it)


def is_whole(path: Path) -> bool:
    """Whether a step directory has both its index and `meta.pt` (its save finished)."""
    return (path / DCP_INDEX).is_file() and (path / META).is_file()


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint path as found: `exists`, `link` and `directory` are read once, when
    it is resolved; what a directory holds is read when asked."""

    path: Path
    exists: bool  # something is there (a link that names nothing is not)
    link: bool  # the path itself is a symbolic link
    directory: bool  # a directory, or a link to one

    @property
    def kind(self) -> CheckpointKind:
        """How ddptrain's readers take it: a directory as a DCP step directory (refused
        there when it is not a whole one), anything else as a `.pt` file."""
        return CheckpointKind.DCP if self.directory else CheckpointKind.FILE

    @property
    def step_dir(self) -> bool:
        """A DCP step directory: DCP's index is in it (`whole` or not)."""
        return self.directory and (self.path / DCP_INDEX).is_file()

    @property
    def whole(self) -> bool:
        """A step directory whose save finished: its index and `meta.pt` are both there."""
        return self.directory and is_whole(self.path)

    @property
    def holds_config(self) -> bool:
        """A directory with a `config.yaml`: a run directory, or an export's."""
        return self.directory and (self.path / RUN_CONFIG).is_file()

    @property
    def run_dir(self) -> bool:
        """A run directory (its newest checkpoint, or its export, is what it names): a
        directory with a `config.yaml` that is no whole step directory."""
        return self.holds_config and not self.whole

    @property
    def own_directory(self) -> bool:
        """A directory that is no link: a link planted in a run directory is not read
        through."""
        return self.directory and not self.link

    @property
    def safetensors(self) -> bool:
        """A safetensors file, by its name (`model.safetensors`, one of its shards)."""
        return not self.directory and self.path.suffix == ".safetensors"


def resolve_checkpoint(path: Path) -> Checkpoint:
    """What is at `path`: the one place a checkpoint path is asked whether it is a
    directory. Nothing is refused here; each reader refuses what it cannot read."""
    return Checkpoint(path=path, exists=path.exists(), link=path.is_symlink(),
                      directory=path.is_dir())


def entries(directory: Path) -> list[Path]:
    """What a checkpoints directory holds; nothing when it is not a directory (a run
    that has not saved yet)."""
    return list(directory.iterdir()) if directory.is_dir() else []
