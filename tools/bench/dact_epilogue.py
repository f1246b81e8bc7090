"""proj's input-gradient product times gelu'(preact), writing the gradient alone: quack's dact product without
its second output (the activation). A block that kept its activation from the forward could use it; the model
keeps the GELU's derivative instead (model.fused_mlp), so only ``bench tiles --dact-outputs`` measures it.

Imported by that sweep alone, after it has checked that quack's GEMMs and the CuTe DSL run here: the import
builds the epilogue with quack's ``@gemm_epilogue`` frontend. A module global, as quack's compile cache wants.
"""

from __future__ import annotations

from quack.epilogue.frontend import gemm_epilogue

from model.quack_gelu import cdf_and_density_in_kernel


@gemm_epilogue()
def gelu_input_gradient(acc, c):
    """dout @ proj's weight times gelu'(c), ``c`` the pre-activation, by model.quack_gelu's formula."""
    cdf, density = cdf_and_density_in_kernel(c)
    return {"D": acc * (c * density + cdf)}
