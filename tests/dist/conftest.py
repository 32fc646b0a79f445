"""One persistent process world per world size, shared by the multi-process tests (see world.py),
and stopped as soon as the last of them has run: an idle gloo rank still costs about 5% of a core
(measured 2026-12-03, 4 ranks idle for 10 s), so the worlds of sizes 2, 4 and 8 would otherwise
slow every test collected after tests/dist by most of a core."""

import pathlib

import pytest

from world import World

HERE = pathlib.Path(__file__).resolve().parent
_WORLDS: dict[int, World] = {}


def _stop_worlds():
    for world in _WORLDS.values():
        world.kill()
    _WORLDS.clear()


@pytest.fixture(scope="session")
def worlds():
    def get(size: int) -> World:
        if size not in _WORLDS:
            _WORLDS[size] = World(size)
        return _WORLDS[size]

    yield get
    _stop_worlds()


def pytest_runtest_teardown(item, nextitem):
    """After the last test of this folder (a later one that needs a world respawns it)."""
    if nextitem is None or HERE not in pathlib.Path(nextitem.path).resolve().parents:
        _stop_worlds()
