"""mLSTM (xLSTM matrix memory) with exponential or sigmoid input gate.

``reference.py`` holds the ground truths (step-by-step recurrence, quadratic parallel form); ``step.py``
the single decoding step that continues from a chunkwise final state.
"""
