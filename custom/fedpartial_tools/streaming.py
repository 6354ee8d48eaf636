"""Stable public name: ``python -m fedpartial_tools.streaming`` (as docs/LARGE_SITES.md wrote it); the code lives in
:mod:`fedpartial_tools.bench.streaming`."""
if __name__ == "__main__":
    from fedpartial_tools.bench.streaming import main

    main()
