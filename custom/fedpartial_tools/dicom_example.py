"""Stable public name: ``python -m fedpartial_tools.dicom_example`` (as README.md wrote it); the code lives in
:mod:`fedpartial_tools.data.dicom_example`."""
if __name__ == "__main__":
    from fedpartial_tools.data.dicom_example import main

    main()
