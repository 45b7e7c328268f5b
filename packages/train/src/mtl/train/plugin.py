"""mtl-train's built-in callbacks, registered through the same hook a third party would use."""

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import TrainCallback
from mtl.train.callbacks import JsonlSink, TensorBoardSink
from mtl.train.wandb_sink import WandbSink


@hookimpl
def mtl_train_callbacks():
    return [
        TrainCallback("jsonl", build=JsonlSink, description="metrics.jsonl in logging.dir"),
        TrainCallback("tensorboard", build=TensorBoardSink, description="TensorBoard event files"),
        TrainCallback("wandb", build=WandbSink, description="Weights & Biases (the wandb package)"),
    ]
