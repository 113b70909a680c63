"""slime_tis: rollout-policy importance sampling for Megatron RL with SGLang rollouts."""

from setuptools import find_packages, setup

setup(
    name="slime_tis",
    version="0.1.0",
    description=(
        "Training-inference mismatch correction (TIS/MIS, rejection sampling, diagnostics) "
        "for Megatron-based RL with SGLang rollouts"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["slime_tis", "slime_tis.*"]),
    # A range, never a pin: users bring their own (CUDA) torch build.
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # megatron-core: 0.16.1 and 0.19.2 tested in CI; 0.20 (Megatron-LM main) where the hook changed
        "megatron": ["megatron-core>=0.16.1,<0.21"],
        "plot": ["matplotlib>=3.7"],
        # psutil: megatron's dist_checkpointing writer; safetensors: the engine-weight export
        "example": ["megatron-core>=0.16.1,<0.21", "matplotlib>=3.7", "tqdm", "tensorboard", "psutil", "safetensors"],
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.6",  # scripts/run_tests.sh: one worker per core, files in collection order
            "hypothesis>=6",
            "ruff",
            "megatron-core>=0.16.1,<0.21",
            "matplotlib>=3.7",
            "tqdm",
            "tensorboard",
            # the Triton kernels run on CPU under TRITON_INTERPRET=1 in the tests (linux x86-64 wheels only)
            "triton>=3.3; sys_platform == 'linux' and platform_machine == 'x86_64'",
            "psutil",
            "safetensors",
            # a real Hugging Face client for the exported engine weights (GPT2LMHeadModel); CPU-only, no torch pin
            "transformers>=4.40",
            # Megatron-LM's tree (tests/dist/test_megatron_rl_real_tree.py): megatron.rl's rollout types and its
            # configuration reader
            "pydantic>=2",
            "pyyaml",
        ],
        # The fused log-prob kernels (slime_tis/kernels); CUDA builds of torch usually bring triton already.
        "kernels": ["triton>=3.3"],
        # GPU-side pieces (transformer-engine, NVIDIA apex, sglang) are never required here;
        # they are imported lazily by the code paths that use them.
    },
    entry_points={"console_scripts": ["slime-tis=slime_tis.cli:main"]},
)
