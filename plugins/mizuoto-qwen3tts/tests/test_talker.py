"""The talker and the code predictor (Qwen3 decoders of mizuoto.nn) give upstream's hidden states and logits.

Each case's recorded inputs are fed in (the talker's prefill embeddings; for the predictor, the
first frame's recorded codes, teacher-forced), so every comparison checks one forward pass.
"""

import torch

from mizuoto_qwen3tts.code_predictor import load_code_predictor
from mizuoto_qwen3tts.talker import load_talker


@torch.inference_mode()
def test_the_talkers_prefill_gives_upstreams_last_hidden_state_and_first_logits(case):
    talker = load_talker(case.model_dir)
    recorded = case.tensors()
    hidden = talker.decoder(recorded["talker_inputs_embeds"], talker.decoder.new_cache())
    logits = talker.head(hidden)[0, -1]  # upstream's head runs over every prefill position; generate takes the last
    case.cpu.assert_equal(hidden[0, -1], recorded["talker_hidden"][0], "talker_hidden", f"{case.name} talker_hidden[0]")
    case.cpu.assert_equal(logits, recorded["talker_first_logits"], "talker_first_logits",
                          f"{case.name} talker_first_logits")


@torch.inference_mode()
def test_the_code_predictor_gives_upstreams_logits_for_each_codebook_of_the_first_frame(case):
    recorded = case.tensors()
    if recorded["codes"].shape[0] == 0:  # no frame completed: upstream never ran its predictor
        assert recorded["predictor_first_logits"].numel() == 0
        return
    talker, predictor = load_talker(case.model_dir), load_code_predictor(case.model_dir)
    codes, cache = recorded["codes"][0], predictor.decoder.new_cache()
    first = torch.cat([recorded["talker_hidden"][0].reshape(1, 1, -1),
                       talker.decoder.embed_tokens(codes[:1]).reshape(1, 1, -1)], dim=1)
    ours = [predictor.logits(first, cache, 1)[0, -1]]
    for book in range(2, codes.shape[0]):
        step = predictor.tables[book - 2](codes[book - 1:book]).reshape(1, 1, -1)
        ours.append(predictor.logits(step, cache, book)[0, -1])
    case.cpu.assert_equal(torch.stack(ours), recorded["predictor_first_logits"], "predictor_first_logits",
                          f"{case.name} predictor_first_logits")
