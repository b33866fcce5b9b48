"""The process test_kill.py kills: it builds a run once, then for each "go FIRST" line on stdin forks a child that
writes checkpoints FIRST, FIRST + 1, ... until it is SIGKILLed at a random moment, and reports the kill.

    python checkpoint_writer.py OUTPUT_DIR ALGO_LOSS SEED
    stdin  "go 7"                     fork a writer starting at step 7
    stdout "saved 7", "saved 8", ...  (from the child: each checkpoint it finished)
           "killed 0.23"              (from this process: the child was killed 0.23 s after it started)

Forking keeps each round to a fraction of a second (no new Python, torch or model per kill). The run is
built with one thread, so the fork copies no thread pool.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time

import torch

from treerl.trainer import load_config
from treerl.trainer.core.run import Run

SETTINGS = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=0", "trainer.threads=1",
            "trainer.steps=1000000", "trainer.keep_checkpoints=2", "trainer.resume=auto", "algo.kl_coef=0.0"]


def main() -> None:
    out, loss, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    run = Run.start(load_config(None, [*SETTINGS, f"trainer.output_dir={out}", f"algo.loss={loss}"]))
    rng = random.Random(seed)
    started = time.perf_counter()  # kill times scale with how long a save takes on this machine, now
    run.save(0)
    save_seconds = time.perf_counter() - started
    shutil.rmtree(os.path.join(out, "checkpoints"))
    sys.stdout.flush()
    os.write(1, b"ready\n")
    for line in sys.stdin:
        first = int(line.split()[1])
        delay = rng.uniform(0.2, 3.0) * save_seconds  # most rounds finish a save or two, then die inside one
        pid = os.fork()
        if pid == 0:  # the writer: checkpoints until killed
            step = first
            while True:
                run.save(step)
                os.write(1, f"saved {step}\n".encode())  # one write: a kill cannot cut the line
                step += 1
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.write(1, f"killed {delay:.3f}\n".encode())


if __name__ == "__main__":
    main()
