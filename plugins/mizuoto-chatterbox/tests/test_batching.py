"""T3 in the runtime's continuous batch (load option compute.batch > 1): a request's cond and uncond rows
(Turbo: its one row) share steps of a fixed width with other requests, and a seeded request speaks the
same audio alone or beside others (batch invariance, as CosyVoice's LM)."""

import threading

import pytest
import torch

from mizuoto.runtime.api import Runtime

BATCH = 3  # requests at once
OTHERS = ("A different sentence, spoken beside it.", "And a third one, longer than the others, to overlap.")


@pytest.fixture(scope="module")
def runtime():
    with Runtime() as rt:
        yield rt


def _options(case, model) -> dict:
    declared = {o.name for o in model.capabilities.options}
    return {k: v for k, v in case.spec["generate_kwargs"].items() if k in declared}


def test_a_request_speaks_the_same_alone_or_beside_others(case, runtime):
    if case.clip is not None or "expected_error" in case.spec:
        return
    name = runtime.load(str(case.model_dir), name=f"batched-{case.name}", watermark=False, compute={"batch": BATCH})
    model = runtime.model(name)
    try:
        assert model.batch_loop() is not None and model.batch_loop().width == BATCH * model.rows_per_request
        request = {"voice": "default", "seed": case.spec["seed"], "options": _options(case, model)}
        alone = list(runtime.synthesize(name, case.spec["text"], **request))[0].samples
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []

        def speak(i: int, text: str, seed: int) -> None:
            try:
                results[i] = list(runtime.synthesize(name, text, **{**request, "seed": seed}))[0].samples
            except BaseException as e:  # reported by the main thread
                errors.append(e)
        steps_before = model.batch_loop().stats()
        threads = [threading.Thread(target=speak, args=(0, case.spec["text"], case.spec["seed"]))]
        threads += [threading.Thread(target=speak, args=(i + 1, text, 100 + i)) for i, text in enumerate(OTHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert torch.equal(results[0], alone), "a batched request's audio depends on the others in its batch"
        after = model.batch_loop().stats()
        assert after["steps"] > steps_before["steps"]
        rows = model.batch_loop().row_steps
        assert rows > after["steps"], "no step was shared by several rows"
    finally:
        runtime.unload(name)


def test_streaming_runs_in_the_batch_too(case, runtime):
    if case.clip is not None or "expected_error" in case.spec:
        return
    name = runtime.load(str(case.model_dir), name=f"batched-stream-{case.name}", watermark=False,
                        compute={"batch": BATCH})
    try:
        model = runtime.model(name)
        request = {"voice": "default", "seed": case.spec["seed"], "options": _options(case, model)}
        whole = list(runtime.synthesize(name, case.spec["text"], **request))[0].samples
        chunks = list(runtime.synthesize(name, case.spec["text"], stream=True, **request))
        assert chunks[-1].final and sum(c.samples.numel() for c in chunks) == whole.numel()
    finally:
        runtime.unload(name)
