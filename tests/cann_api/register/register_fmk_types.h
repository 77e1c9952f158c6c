// Declarations only (see ../README.md). Source of the facts: metadef inc/external/register/register_fmk_types.h.
#ifndef SGDFUSE_TEST_CANN_REGISTER_FMK_TYPES_H_
#define SGDFUSE_TEST_CANN_REGISTER_FMK_TYPES_H_
namespace domi {
enum FrameworkType { CAFFE = 0, MINDSPORE = 1, TENSORFLOW = 3, ANDROID_NN = 4, ONNX = 5, FRAMEWORK_RESERVED = 6 };
}  // namespace domi
#endif
