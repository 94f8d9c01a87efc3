"""Visual generation's task: scenes a prompt asks for, their pictures, and the judge.

scenes.py   what a prompt asks (count, colour, shape, position), by GenEval's
            categories, with a fixed held-out split of whole scenes
render.py   procedural pictures of a scene (pretraining data, and the judge's reference)
check.py    the judge: colour segmentation, then counts, colours, shapes and positions
"""
