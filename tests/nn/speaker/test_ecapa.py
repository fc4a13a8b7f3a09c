"""ECAPA-TDNN on hand-made sizes: shapes, its size checks, and what its pooling computes."""

import pytest
import torch

from mizuoto.nn.speaker.ecapa import ECAPATDNN, AttentiveStatsPooling, Res2Net

SIZES = dict(mels=10, embed_dim=6, channels=[8, 8, 8, 24], kernel_sizes=[5, 3, 3, 1], dilations=[1, 2, 3, 1],
             attention_channels=4, res2net_scale=4, se_channels=4)


@torch.inference_mode()
def test_a_batch_of_mels_gives_one_embedding_each():
    torch.manual_seed(0)
    net = ECAPATDNN(**SIZES).eval()
    assert net(torch.randn(3, 40, SIZES["mels"])).shape == (3, SIZES["embed_dim"])
    assert len(net.blocks) == len(SIZES["channels"]) - 1  # the first TDNN, then one SE-Res2Net block per middle size


def test_sizes_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="one length"):
        ECAPATDNN(**{**SIZES, "dilations": [1, 2, 1]})


def test_res2net_channels_must_split_into_its_groups():
    with pytest.raises(ValueError, match="do not split"):
        Res2Net(10, 4, 3, 1)


@torch.inference_mode()
def test_pooling_a_constant_signal_gives_its_value_and_the_std_floor():
    torch.manual_seed(0)
    pool = AttentiveStatsPooling(3, 2).eval()
    value = torch.tensor([0.5, -2.0, 3.0])
    out = pool(value.reshape(1, 3, 1).expand(1, 3, 17).contiguous())
    assert out.shape == (1, 6, 1)
    torch.testing.assert_close(out[0, :3, 0], value)
    # every frame equal: no variance, so each std is the square root of the floor
    torch.testing.assert_close(out[0, 3:, 0], torch.full((3,), pool.eps ** 0.5))
