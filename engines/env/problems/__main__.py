"""``python -m sluice.engines.env.problems``: print the built-in task's solution-length histograms."""

from sluice.engines.env.problems.lengths import main

if __name__ == "__main__":
    main()
