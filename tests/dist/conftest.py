"""One persistent process world per world size for the whole session (see world.py)."""

import pytest

from world import World


@pytest.fixture(scope="session")
def worlds():
    cache: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in cache:
            cache[size] = World(size)
        return cache[size]

    yield get
    for world in cache.values():
        world.kill()
