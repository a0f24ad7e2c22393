"""Fixtures for the tests that run a real engine worker."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration import harness, pinning
from tests.integration.engine_harness import Spawner, Worker

# A suite started in the background by a non-interactive shell (`make test &`) inherits
# SIGINT ignored, and so does every process it starts: the CLI then ignores the Ctrl-C
# the tests send it (`get -w`, `logs -f`) and they time out. Tests that interrupt a
# child expect what a terminal gives it, so the suite restores Python's own handler
# (a child's disposition is then the default again after exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def spawn(model_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(model_path)
    yield spawner
    spawner.close()


@pytest.fixture(scope="session")
def worker(model_path: Path) -> Iterator[Worker]:
    """One worker shared by the tests that leave it as they found it, in every module
    that does not start its own: an engine loads the model once for all of them. What
    they leave behind is what any engine keeps between requests (cached prefixes, log
    lines), so a test reads only what it caused (a module that needs a fresh worker,
    as test_engine_worker's Health test does, defines its own)."""
    spawner = Spawner(model_path)
    w = spawner()
    w.wait_ready()
    yield w
    spawner.close()


@pytest.fixture(scope="session")
def tokenize(model_path: Path) -> Callable[[str], list[int]]:
    """An independent tokenizer (llama-cpp-python's high-level vocab-only model)."""
    from llama_cpp import Llama

    vocab = Llama(str(model_path), vocab_only=True, verbose=False)
    return lambda s: list(vocab.tokenize(s.encode(), add_bos=True, special=True))


@pytest.fixture(scope="session")
def no_eog(model_path: Path) -> dict[int, float]:
    """A logit bias banning end-of-generation: the request runs to max_tokens on every
    CPU (an unconstrained model stops whenever its numbers say so)."""
    return pinning.no_end_of_generation(model_path)


@pytest.fixture(scope="session")
def default_daemon(model_path: Path) -> Iterator[harness.Daemon]:
    """One daemon serving the default fleet (manifests/), shared by the modules whose
    tests only send it requests: none applies or deletes an object, kills a process or
    edits its fleet, so each finds it as the fleet describes it. A daemon and its
    6-slot engine start once for all of them instead of once per module."""
    with harness.default_fleet() as d:
        yield d


@pytest.fixture(scope="session")
def tools_daemon(model_path: Path) -> Iterator[harness.Daemon]:
    """One daemon with one Lane (`harness.TOOLS_LANE`: the bundled model,
    `harness.TOOLS_SLOTS` slots of 4,096 tokens), shared by the tool-calling and
    Responses modules of every dialect and the Node.js client's, whose tests only send
    it requests. Its daemon and engine start once for them all."""
    home = harness.short_home()
    fleet = harness.local_fleet(
        home,
        model_path,
        lane=harness.TOOLS_LANE,
        spec=(
            f"replicas: 1, slots: {harness.TOOLS_SLOTS}, "
            f"contextPerSlot: {harness.TOOLS_CONTEXT_PER_SLOT}"
        ),
    )
    d = harness.Daemon(home=home, watch=fleet).start()
    try:
        d.wait_condition("lane", harness.TOOLS_LANE, "Ready", timeout=240)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
