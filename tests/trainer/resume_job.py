"""PipeTrainer runs that save checkpoints every 3 steps or resume from one, started by `accelerate launch`.

``resume_job.py RUNS_JSON`` trains each run of the JSON list in turn, in the same processes (a run
is described in tests/helpers/resume_runs.py).
"""

import json
import sys

from resume_runs import run

if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        run(spec)
