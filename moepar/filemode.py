"""File modes: a file moepar writes gets what `open()` (and `torch.save`) would give it under the
process umask, 0644 under the usual 022, so a checkpoint on a shared filesystem is readable by the
user's other jobs and colleagues. safetensors' `save_file` (0.8) creates 0600 files; its callers
pass each file through `follow_umask`.
"""

import os

__all__ = ["umask", "follow_umask"]


def umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc/self/status), so
    a thread creating a file meanwhile never sees a cleared mask; elsewhere set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str, mode: int = 0o666):
    """Sets `path` to `mode` less the umask (what creating it with open() would have given)."""
    os.chmod(path, mode & ~umask())
