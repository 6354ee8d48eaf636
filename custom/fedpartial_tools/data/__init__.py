"""A site's data: finding the sites of a data root (:mod:`.sites`), importing a hospital's own images
(:mod:`.importer` with its readers :mod:`.images`, :mod:`.dicom`, :mod:`.nifti`), splitting a
source into site files (:mod:`.partition`), harmonising sources onto one grid (:mod:`.harmonise`),
and the built-in synthetic data and DICOM example (:mod:`.synthetic`, :mod:`.dicom_example`).
May import the runtime only."""
