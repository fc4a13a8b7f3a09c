"""The talker's prompt: the rows it reads before its first draw, the text rows it reads after, and the pad row.

Upstream (`qwen-tts` 0.1.1) lays the prompt out as (T(x): text ids through the talker's text table
and `text_projection`; C(x): codec ids through the talker's codec table):

1. an instruction, when given: T(its whole user turn);
2. the role: T(`<|im_start|>assistant\\n`), the speech prompt's first 3 ids;
3. the codec prefix `[think, think_bos, language, think_eos]` (`[nothink, think_bos, think_eos]`
   for language "auto"), the speaker row (a preset's C(speaker id), or a clone's x-vector), then
   `[pad, bos]`; every row but the last is added to T(tts_pad), the last of them to T(tts_bos);
4. the text, by mode:
   - streaming: T(first text id) + C(bos); the other text ids and T(tts_eos) trail, one row added
     to the talker's input per frame, T(tts_pad) after them;
   - non-streaming: T(every text id) and T(tts_eos), each + C(pad), then T(tts_pad) + C(bos);
     T(tts_pad) trails;
   - a clone with a reference transcript and the reference's codes (ICL): the text is the
     reference's transcript followed by the text to speak, then T(tts_eos); the codec rows are
     C(bos) then each reference frame's 16 code embeddings summed. Non-streaming: text + C(pad),
     then codec + T(tts_pad); streaming: text and codec added row by row over the codec's length,
     the text's remainder trailing (or, when the text is not longer, padded with T(tts_pad)).

Float results depend on the shapes of each call, so every text row is embedded and projected in
the same groups as upstream's (e.g. tts_bos, tts_eos and tts_pad as one 3-row call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mizuoto.errors import InvalidRequest
from mizuoto_qwen3tts.code_predictor import CodePredictor
from mizuoto_qwen3tts.ids import AUTO, ModelIds
from mizuoto_qwen3tts.prompt import REF_TAIL, ROLE_IDS, UNSPOKEN_TAIL, Prompts
from mizuoto_qwen3tts.talker import Talker


@dataclass(frozen=True)
class Prefill:
    """What the talker's decode starts from.

    `inputs_embeds` (1, P, H): the prompt; `trailing` (1, Tt, H): rows added to the input of
    decode steps 0, 1, ...; `pad` (1, 1, H): what is added once those are used up.
    """

    inputs_embeds: torch.Tensor
    trailing: torch.Tensor
    pad: torch.Tensor


def language_id(ids: ModelIds, language: str | None, speaker: str | None) -> int | None:
    """The codec language id of a request (None: "auto" without a dialect speaker); unknown names refused."""
    name = AUTO if language is None else str(language).lower()
    if name not in ids.supported_languages:
        raise InvalidRequest(f"unsupported language {language!r}; this model supports "
                             f"{sorted(ids.supported_languages)}", field="options")
    dialect = ids.dialects.get(speaker.lower()) if speaker else None
    if dialect is not None and name in ("chinese", AUTO):  # a dialect speaker speaks its dialect for these
        return ids.languages[dialect]
    return None if name == AUTO else ids.languages[name]


def speaker_id(ids: ModelIds, speaker: str | None) -> int | None:
    """The codec id of a preset speaker (None: no speaker named); an unknown speaker refused."""
    if not speaker:
        return None
    if speaker.lower() not in ids.speakers:
        known = ids.supported_speakers
        raise InvalidRequest(f"unsupported speaker {speaker!r}; " + (f"this model's speakers are {known}" if known
                             else "this model has no preset speakers"), field="voice")
    return ids.speakers[speaker.lower()]


class PrefillBuilder:
    """Builds a request's `Prefill` from its texts and voice with one model's talker, code predictor and ids."""

    def __init__(self, talker: Talker, predictor: CodePredictor, ids: ModelIds, prompts: Prompts | None = None) -> None:
        self.talker, self.predictor, self.ids, self.prompts = talker, predictor, ids, prompts

    def _ids(self, ids: list) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.talker.head.weight.device)

    def _codec(self, ids: list[int]) -> torch.Tensor:
        return self.talker.codec(self._ids([ids]))

    @torch.inference_mode()
    def build(self, text: str, language: str | None = None, speaker: str | None = None, instruct: str | None = None,
              ref_text: str | None = None, speaker_embedding: torch.Tensor | None = None,
              ref_codes: torch.Tensor | None = None, non_streaming_mode: bool = False) -> Prefill:
        """The prefill of one request from its texts (tokenized with the model dir's tokenizer); see `embed`."""
        if self.prompts is None:
            raise ValueError("this builder has no tokenizer: build it with `prompts`, or call `embed` with ids")
        return self.embed(
            self.prompts.speech(text), language, speaker,
            instruct_ids=self.prompts.instruction(instruct) if instruct else None,
            ref_ids=self.prompts.reference(ref_text) if ref_text else None,
            speaker_embedding=speaker_embedding, ref_codes=ref_codes, non_streaming_mode=non_streaming_mode)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, language: str | None = None, speaker: str | None = None, *,
              instruct_ids: torch.Tensor | None = None, ref_ids: torch.Tensor | None = None,
              speaker_embedding: torch.Tensor | None = None, ref_codes: torch.Tensor | None = None,
              non_streaming_mode: bool = False) -> Prefill:
        """The prefill of one request from its ids (1, L) (`prompt.Prompts`).

        `speaker`: a preset speaker's name (CustomVoice); `speaker_embedding` (H,): a clone's x-vector;
        neither: no speaker row (VoiceDesign). `ref_codes` (Tr, groups) with `ref_ids`: an ICL clone.
        `language` None is "auto". An unknown language or speaker is an InvalidRequest.
        """
        ids, talker = self.ids, self.talker
        if speaker and speaker_embedding is not None:
            raise ValueError("a request speaks with a preset speaker or a clone's x-vector, not both")
        if ref_codes is not None and ref_ids is None:
            raise InvalidRequest("a clone from the reference's codes needs its transcript (ref_text)",
                                 field="reference")
        language = language_id(ids, language, speaker)
        preset = speaker_id(ids, speaker)
        bos, eos, pad = talker.text(self._ids([[ids.tts_bos, ids.tts_eos, ids.tts_pad]])).chunk(3, dim=1)

        prefix = ([ids.nothink, ids.think_bos, ids.think_eos] if language is None
                  else [ids.think, ids.think_bos, language, ids.think_eos])
        codec = [self._codec(prefix)]
        if preset is not None:
            codec.append(talker.codec(self._ids(preset)).view(1, 1, -1))
        elif speaker_embedding is not None:
            weight = talker.head.weight
            codec.append(speaker_embedding.to(weight.device).to(weight.dtype).view(1, 1, -1))
        codec.append(self._codec([ids.codec_pad, ids.codec_bos]))
        codec = torch.cat(codec, dim=1)
        role = talker.text(input_ids[:, :ROLE_IDS])
        # every codec row but the last rides on tts_pad, the last of them on tts_bos
        head = torch.cat((pad.expand(-1, codec.shape[1] - 2, -1), bos), dim=1) + codec[:, :-1]
        rows = torch.cat((role, head), dim=1)

        spoken = input_ids[:, ROLE_IDS:-UNSPOKEN_TAIL]
        if ref_codes is not None:
            text_rows, trailing = self._icl(torch.cat([ref_ids[:, ROLE_IDS:-REF_TAIL], spoken], dim=-1), ref_codes,
                                            eos, pad, non_streaming_mode)
        elif non_streaming_mode:
            text = torch.cat((talker.text(spoken), eos), dim=1) + self._codec([ids.codec_pad] * (spoken.shape[1] + 1))
            text_rows, trailing = torch.cat([text, pad + self._codec([ids.codec_bos])], dim=1), pad
        else:
            text_rows = talker.text(input_ids[:, ROLE_IDS:ROLE_IDS + 1]) + codec[:, -1:]
            trailing = torch.cat((talker.text(input_ids[:, ROLE_IDS + 1:-UNSPOKEN_TAIL]), eos), dim=1)
        rows = torch.cat([rows, text_rows], dim=1)
        if instruct_ids is not None:
            rows = torch.cat([talker.text(instruct_ids), rows], dim=1)
        return Prefill(rows, trailing, pad)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """Frames of codes (T, groups) as the talker reads them: each group's embedding, summed (1, T, H)."""
        tables = [self.talker.codec] + list(self.predictor.tables)
        rows = [tables[g](codes[:, g:g + 1]) for g in range(codes.shape[1])]
        return torch.cat(rows, dim=1).sum(1).unsqueeze(0)

    def _icl(self, text_ids: torch.Tensor, ref_codes: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor,
             non_streaming_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of an ICL clone's text (reference transcript + text) and reference codes, and its trailing rows."""
        if ref_codes.dim() != 2 or ref_codes.shape[1] != self.ids.groups:
            raise ValueError(f"reference codes must be (frames, {self.ids.groups}), not {tuple(ref_codes.shape)}")
        text = torch.cat([self.talker.text(text_ids), eos], dim=1)
        ref_codes = ref_codes.to(self.talker.head.weight.device)
        codec = torch.cat([self._codec([self.ids.codec_bos]), self.frame_embedding(ref_codes)], dim=1)
        if non_streaming_mode:
            text = text + self._codec([self.ids.codec_pad] * text.shape[1])
            return torch.cat([text, codec + pad], dim=1), pad
        if text.shape[1] > codec.shape[1]:
            return text[:, :codec.shape[1]] + codec, text[:, codec.shape[1]:]
        text = torch.cat([text] + [pad] * (codec.shape[1] - text.shape[1]), dim=1)
        return text + codec, pad
