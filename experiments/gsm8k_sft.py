"""SFT of your own model on your own GSM8K-shaped data, with the tokenizer's chat template:
the starting point of ``experiments/gsm8k_grpo.py``.

As shipped it runs a random-init model of Qwen2.5-0.5B's exact shape and a BPE tokenizer
with a Qwen-style chat template (``tools/make_model.py``) on GSM8K-like problems that
reasoning-gym's ``gsm_symbolic`` generates (``tools/make_dataset.py``), which is what
``tools/smoke_real_size.py`` runs on a CPU. For your own: set ``model.path`` to your HF
directory and ``task.train_path``/``task.eval_path`` to your files (JSONL or Parquet; map
their columns with ``task.fields``). Rows of a question and a worked solution ending in
``#### answer`` train on the solution; held-out accuracy is graded by math-verify.
"""

from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

# The instruction GSM8K's worked solutions follow: the final answer after "####", which
# the math reward reads.
SYSTEM_PROMPT = "Solve the problem step by step. Write the final answer after ####."

TASK = TaskConfig(
    source="dataset",
    train_path="runs/data/gsm8k/train.jsonl",
    eval_path="runs/data/gsm8k/eval.jsonl",
    fields={"prompt": "question"},
    prompt_format="chat",
    system_prompt=SYSTEM_PROMPT,
    rewards={"math": 1.0},
)

config = SFTExperiment(
    name="gsm8k_sft",
    model=ModelConfig(path="runs/models/qwen2.5-0.5b-shape"),
    task=TASK,
    # Activations of a 0.5B model at 2k tokens a micro-batch fit a few GB; rows of 1k
    # tokens hold a GSM8K prompt and worked solution (about 300 tokens) three times over.
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=2048, row_tokens=1024),
    # 1e-5: the usual full-parameter SFT rate for models of this size.
    optim=OptimConfig(lr=1e-5, warmup_steps=10),
    sft=SFTConfig(batch_size=32, max_steps=500, export_dir="runs/models/gsm8k-sft"),
    eval=EvalConfig(every_steps=100, num_examples=100, max_new_tokens=320, batch_size=32),
)
