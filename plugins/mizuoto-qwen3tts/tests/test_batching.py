"""The talker in the runtime's continuous batch (load option compute.batch > 1): a request's row shares steps of
a fixed width with other requests, and a seeded request speaks the same audio alone or beside others (batch
invariance, as CosyVoice's and Chatterbox's LMs); its code predictor runs on the batch loop between steps."""

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


def test_a_request_speaks_the_same_alone_or_beside_others(case, runtime):
    name = runtime.load(str(case.model_dir), name=f"batched-{case.name}", device="cpu", compute={"batch": BATCH})
    model = runtime.model(name)
    try:
        assert model.batch_loop() is not None and model.batch_loop().width == BATCH
        request = case.request({o.name for o in model.capabilities.options})
        text = request.pop("text")
        alone = list(runtime.synthesize(name, text, **request))[0].samples
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []

        def speak(i: int, text: str, seed: int) -> None:
            try:
                results[i] = list(runtime.synthesize(name, text, **{**request, "seed": seed}))[0].samples
            except BaseException as e:  # reported by the main thread
                errors.append(e)
        steps_before = model.batch_loop().stats()
        threads = [threading.Thread(target=speak, args=(0, text, request["seed"]))]
        threads += [threading.Thread(target=speak, args=(i + 1, other, 100 + i)) for i, other in enumerate(OTHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert torch.equal(results[0], alone), "a batched request's audio depends on the others in its batch"
        after = model.batch_loop().stats()
        assert after["steps"] > steps_before["steps"]
    finally:
        runtime.unload(name)


def test_streaming_runs_in_the_batch_too(case, runtime):
    name = runtime.load(str(case.model_dir), name=f"batched-stream-{case.name}", device="cpu",
                        compute={"batch": BATCH})
    try:
        model = runtime.model(name)
        request = case.request({o.name for o in model.capabilities.options})
        text = request.pop("text")
        whole = list(runtime.synthesize(name, text, **request))[0].samples
        chunks = list(runtime.synthesize(name, text, stream=True, **request))
        assert chunks[-1].final and sum(c.samples.numel() for c in chunks) == whole.numel()
    finally:
        runtime.unload(name)
