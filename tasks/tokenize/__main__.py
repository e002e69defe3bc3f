"""python -m tasks.tokenize: tokenize from the command line (tasks.tokenize.stage.main)."""
from tasks.tokenize.stage import main

if __name__ == "__main__":
    main()
