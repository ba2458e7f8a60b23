"""``python -m engines.problems``: print the built-in task's solution-length histograms."""

from engines.problems.lengths import main

if __name__ == "__main__":
    main()
