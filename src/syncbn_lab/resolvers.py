"""The configs' OmegaConf resolvers, registered when this module is imported.

``${mul:a,b,...}``: the product of its arguments (a study at GPU scale derives its global
batch and learning rate from the images per GPU).
"""

import math

from omegaconf import OmegaConf

OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(xs), replace=True)
