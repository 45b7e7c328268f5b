from mtl.core.config import TrainConfig
from mtl.train.precision import LossScaler


def test_fp16_scaler_backs_off_counts_and_grows():
    scaler = LossScaler.for_config(TrainConfig(precision="fp16", initial_loss_scale=1024.0, loss_scale_window=2))
    assert scaler.dynamic and scaler.scale == 1024.0
    assert scaler.update(found_inf=True) is True
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    assert scaler.update(False) is False
    assert scaler.update(False) is False
    assert scaler.scale == 1024.0  # two clean steps double it
    restored = LossScaler.for_config(TrainConfig(precision="fp16"))
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_bf16_has_no_scaling_but_reports_overflow():
    scaler = LossScaler.for_config(TrainConfig(precision="bf16"))
    assert not scaler.dynamic and scaler.scale == 1.0
    assert scaler.update(True) is True and scaler.scale == 1.0
