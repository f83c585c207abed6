# megatron-geo on the NVIDIA NGC PyTorch image (multi-arch: builds on aarch64 GH200 and x86-64 alike; CUDA,
# NCCL, cuDNN and Transformer Engine come with the image). PyTorch >= 2.9 is needed (torch.optim.Muon):
# NGC 25.10 or newer. The image's torch is kept; nothing is downloaded at run time.
#
#   docker build -t megatron-geo .                        # --build-arg BASE_IMAGE=... / WANDB_MODE=online
#   docker run --gpus all --rm -it megatron-geo scripts/launch_local.sh --config configs/tiny.yaml train.steps=20
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

# wandb mode for wandb's own tools in the image; the trainer's mode is logging.wandb (offline by default)
ARG WANDB_MODE=offline
ENV WANDB_MODE=${WANDB_MODE} \
    PYTHONUNBUFFERED=1

WORKDIR /workspace/megatron-geo
# dependencies first (a code change does not reinstall them)
COPY pyproject.toml README.md ./
COPY megatron_geo ./megatron_geo
COPY scripts ./scripts
RUN scripts/container_install.sh eval
COPY pretrain_llama.py Makefile ./
COPY configs ./configs
COPY tools ./tools
COPY benchmarks ./benchmarks
COPY tests ./tests
RUN python pretrain_llama.py --config configs/tiny.yaml --print-config > /dev/null
