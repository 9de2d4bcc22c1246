"""The stage layer: one launcher per stage of the pipeline, between the wrapper and the kernels.

A launcher checks its arguments (``oracle.validate``, before any launch), moves them to the device,
picks the stage's route (:mod:`numqsa.plan`) and launches the kernels of :mod:`numqsa.kernels`.
:class:`numqsa.QSAPrefillWrapper` records :func:`~numqsa.stages.selection.select_launch` and
:func:`~numqsa.stages.attention.attention_launch`; the single-stage public functions
(``index_keys`` ... ``page4_attention``, the metadata adapters) are launchers of this layer.
"""
