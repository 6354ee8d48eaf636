"""Stable public name: ``python -m fedpartial_tools.fedia_report`` (as docs/SMALL_LESIONS.md wrote it); the code lives in
:mod:`fedpartial_tools.bench.fedia_report`."""
if __name__ == "__main__":
    from fedpartial_tools.bench.fedia_report import main

    main()
