"""The `ftengine` command from a source checkout: `python cli.py encode ...`.

The app itself is ftengine/cli.py, installed as the `ftengine` console script.
"""

from ftengine.cli import main

if __name__ == "__main__":
    main()
