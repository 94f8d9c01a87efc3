"""SFT of a tiny Qwen2 model (1M parameters, character tokenizer) on ``arithmetic_series``:
the n-th term of an arithmetic series, found by writing the series out
(``asyncrl/tasks/series.py``), worked solutions of 15 to 400 tokens, most of them short.
It teaches the format and leaves accuracy for RL to add: a chain is right only if every
term in it is. The
exported HF checkpoint at ``runs/models/longtail-sft`` is where ``longtail_grpo`` starts.
"""

from asyncrl.evaluation import EvalConfig
from asyncrl.models import ModelConfig, TinyModelConfig
from asyncrl.stages.sft import SFTConfig, SFTExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig

# A generation budget above the longest worked solution (400 tokens): what is cut there
# is a policy that failed to stop, and is counted as truncated.
MAX_NEW_TOKENS = 512

TASK = TaskConfig(
    dataset="arithmetic_series",
    dataset_kwargs={},
    prompt_template="{question}:",
    completion_template=" {solution}",
    # 8,000 problems, ~6,600 of them short, of ~36,000 distinct short ones: the held-out
    # and RL splits (which drop what train has) keep nearly the same share of short ones.
    train_size=8000,
)

config = SFTExperiment(
    name="longtail_sft",
    # Positions for a 25-token prompt plus the 512-token budget.
    model=ModelConfig(
        path="runs/models/tiny-longtail",
        make_if_missing=True,
        tiny=TinyModelConfig(max_positions=640),
    ),
    task=TASK,
    # Rows of 512: the longest sequence (~440 tokens) fits one row, short ones pack.
    trainer=TrainerConfig(num_ranks=1, micro_batch_tokens=8192, row_tokens=512),
    optim=OptimConfig(lr=1e-3, warmup_steps=20, min_lr_ratio=0.05),
    # 420 steps leave ~68% held-out for RL to add to (600 reach 90%). Fewer leave a policy
    # that is right on few long chains: at 300 (14%) RL trained on short ones only (the
    # long ones' groups scored all 0 and were filtered) and lost accuracy.
    sft=SFTConfig(batch_size=64, max_steps=420, export_dir="runs/models/longtail-sft"),
    eval=EvalConfig(every_steps=60, num_examples=200, max_new_tokens=MAX_NEW_TOKENS),
)
