"""Every speculator emits the tokens, and takes the steps, recorded in
tests/snapshots/decode_outputs.json (greedy and sampled, adaptive and fixed depth):
refactors of the loop must leave decoding exactly as it was."""

import json

import pytest

from tests import decode_outputs as golden
from tests.conftest import slow_cases


@pytest.fixture(scope="module")
def pair():
    return golden.models()


@pytest.fixture(scope="module")
def snapshot():
    return json.loads(golden.SNAPSHOT.read_text())


def test_snapshot_covers_every_case(pair, snapshot):
    assert sorted(snapshot) == sorted(k for k, _ in golden.cases(*pair))
    assert list(golden.speculators(*pair)) == list(golden.NAMES)


# the default run replays one speculator of each kind (n-gram, draft model, Medusa,
# EAGLE-3) and plain decoding; the other recordings run with -m slow
SLOW = ("self", "eagle2", "eagle1_static")


@pytest.mark.parametrize("name", slow_cases(golden.NAMES, SLOW))
def test_outputs_match_the_recording(pair, snapshot, name):
    target, draft = pair
    for key, kwargs in golden.cases(target, draft):
        if key.split("/")[0] == name:
            assert golden.run(target, kwargs) == snapshot[key], key
