"""Stable public name: ``python -m fedpartial_tools.privacy`` (as docs/FAILURE_BEHAVIOUR.md wrote it); the code lives in
:mod:`fedpartial_tools.bench.privacy`."""
if __name__ == "__main__":
    from fedpartial_tools.bench.privacy import main

    main()
