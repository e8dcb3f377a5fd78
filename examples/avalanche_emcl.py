"""EMCL in an Avalanche script, beside Avalanche's own Naive (SGD) and LaMAML strategies.

    make setup-avalanche && .venv/bin/python examples/avalanche_emcl.py [--tasks 5 --samples 200]

The stream is this project's Permuted MNIST (the embedded digits: no download), one Avalanche
experience per task; each strategy trains on it in the same order and is evaluated on every
task's test images with Avalanche's metrics. Prints each strategy's ACC (mean final accuracy, %).
"""
import argparse

import torch
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training import Naive
from avalanche.training.supervised.lamaml_v2 import LaMAML  # not re-exported by avalanche.training
from avalanche.training.plugins import EvaluationPlugin

from emcl_continual.avalanche import EMCLStrategy, avalanche_benchmark
from emcl_continual.data.models import build_model
from emcl_continual.data.streams import make_stream

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tasks", type=int, default=5)
parser.add_argument("--samples", type=int, default=200, help="training samples per task")
args = parser.parse_args()

stream = make_stream("permuted-mnist", seed=0, n_tasks=args.tasks, samples_per_task=args.samples)
bench = avalanche_benchmark(stream)
strategies = {
    "EMCL": lambda m, ev: EMCLStrategy(model=m, preset="permuted-mnist", inner_lr=0.03, evaluator=ev),
    "Naive": lambda m, ev: Naive(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.03),
                                 train_mb_size=10, evaluator=ev),
    "LaMAML": lambda m, ev: LaMAML(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                   alpha_init=0.3, train_mb_size=10, eval_mb_size=1000, evaluator=ev),
}
for name, make in strategies.items():
    torch.manual_seed(0)
    evaluator = EvaluationPlugin(accuracy_metrics(stream=True), loggers=[])
    strategy = make(build_model(stream.info), evaluator)
    for exp in bench.train_stream:
        strategy.train(exp, shuffle=False, eval_streams=[])
    res = strategy.eval(bench.test_stream)
    acc = next(v for k, v in res.items() if k.startswith("Top1_Acc_Stream/eval_phase/test_stream"))
    print(f"{name:7s} ACC {100 * acc:5.1f} %  ({args.tasks} tasks x {args.samples} samples)")
