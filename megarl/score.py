"""`python -m megarl.score`, the documented command for the offline scoring tool, which lives with the
rewards it scores (megarl/rewards/score.py)."""

import sys

from megarl.rewards.score import main

if __name__ == "__main__":
    sys.exit(main())
